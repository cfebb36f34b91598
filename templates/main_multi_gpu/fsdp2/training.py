{# parallelism=fsdp2: how the model trains under FSDP2, where ddp/training.py has
   its own version. Macros, called by name from the section files
   (`{{ par.train_step() }}`), in the order the generated file uses them; ddp/
   defines the same names. A macro's text is exactly the lines it stands for: its
   last newline comes from the line that calls it. #}
{# Names the section files use: the module train_pass() calls train(), and where
   the Step module that holds the model sits. #}
{% set wrapper, step_host, step_sees = (
    "train_model", "The root of the sharding", "FSDP2 sees"
) %}

{% macro intro() %}
# Data-parallel training with PyTorch's fully sharded data parallelism (FSDP2): one
# process per GPU (or two on CPU), each training the model on its share of every batch
# while holding only 1/world_size of the parameters, gradients and optimizer state.
# The four changes from a single-GPU script are marked "DDP change N":
#   1. join the process group described by the launcher's environment
#   2. a DistributedSampler shards the data, and set_epoch reshuffles it every epoch
#   3. fully_shard() shards the model's parameters over the processes
#   4. only rank 0 prints; every rank writes its shards of a checkpoint, and rank 0
#      the whole model at the end
{%- endmacro %}

{% macro docstring() %}
"""Train a model sharded with FSDP2, on one machine or several."""
{%- endmacro %}

{% macro build_model_doc() %}
    """Return the plain model (FSDP2 shards it later). Its normalization layers are
    written inline, nn.BatchNorm2d(C), so they are easy to find and swap."""
{%- endmacro %}

{% macro compute_loss_doc() %}
    `model` is the model sharded by FSDP2, called inside its root's forward pass.
{%- endmacro %}

{% macro compute_metrics_doc() %}
    `model` is the sharded model (not compiled), in eval mode, without grad and
    without --amp's autocast, called inside its root's forward pass.
{%- endmacro %}

{% macro constants() %}
# What every rank holds whole (BatchNorm's buffers, which FSDP2 does not shard, and
# each rank keeps its own of): rank 0's copy goes into a checkpoint, consistent.
RANK_0_WRITES_REPLICAS = DefaultSavePlanner(dedup_save_to_lowest_rank=True)
# torch 2.7 to 2.10 warn that an API their own checkpoint code uses is deprecated.
warnings.filterwarnings("ignore", "TypedStorage is deprecated")
{%- endmacro %}

{% macro training_fields() %}
    - model: sharded over the ranks (DDP change 3): saved
    - sharded: it in a Step, the root of the sharding: evaluated
    - train_model: the same, compiled with --compile: trained
{%- endmacro %}

{% macro train_step() %}
    # DDP change 3 (FSDP2): gradients are reduce-scattered over the ranks in the
    # backward pass of the last micro-batch of each update only.
    t.sharded.set_requires_gradient_sync(sync)
    # Without --amp no autocast context at all: a disabled one costs time too
    with torch.autocast(device.type, amp) if amp else contextlib.nullcontext():
        loss, n, units, ahead = t.train_model(batch, real, turn, more)  # see Step
    # The loss summed over the batch's n units, at the usual scale (times n / batch
    # size, left out where that is 1: a per-sample loss); update() divides by the
    # mean weight, which the gradients' reduction brings (`units`, `ahead`: zero).
    # Alone, that weight would cancel: left out, unless a stand-in's (0).
    total = t.scaler.scale(loss) + units
    if not (t.alone and real) and (torch.is_tensor(n) or n != args.batch_size):
        total = total * (n / args.batch_size)
    (total if ahead is None else total + ahead).backward()
{%- endmacro %}

{% macro evaluation_comment() %}
        # Each rank keeps its own BatchNorm running statistics: take rank 0's, which
        # the checkpoints and model_final.pt hold. Every rank takes every forward.
{%- endmacro %}

{% macro build_training_doc() %}
    """Data, model sharded with FSDP2, optimizer and loss scaler, as build_* say."""
{%- endmacro %}

{% macro wrap_model() %}
    # DDP change 3 (FSDP2), before the optimizer; evaluated through the root, which
    # gathers its own parameters.
    t.sharded = t.evaluated = build_sharded(args, device)
    t.train_model = torch.compile(t.sharded) if args.compile else t.sharded
    t.model = t.sharded.model
    t.trained = list(t.sharded.parameters())  # the model's, and the Step's units
    t.optimizers, t.schedulers = named(build_optimizer(t.model, args, t.total_updates))
    if any(evaluate is not None for _, evaluate in KEPT.values()):
        raise failure("error: keep(..., evaluate=) needs parallelism=ddp", status=2)
    return t


def build_sharded(args, device):
    """DDP change 3 (FSDP2): the model build_model() makes, its parameters sharded over
    the ranks block by block: fully_shard() on each of sharded_blocks(model), then on
    the root, which keeps the rest. A block's parameters are gathered from all ranks
    for its forward and backward, and freed after; its gradients are reduce-scattered.
    So each rank holds 1/world_size of the parameters, of the gradients, and of the
    optimizer state (the optimizer, built after this, sees the shards).

    No rank but 0 ever holds the whole model: each builds it on the meta device
    (shapes, no memory), shards it, and makes room for its own shards only; rank 0
    also builds it for real (the seed's initial weights, or what build_model loads,
    as one process would) and sends it, a tensor at a time, into every rank's shards.
    A build_model that refuses the meta device (transformers' from_pretrained) builds
    a whole copy on each rank's CPU instead, dropped before the sharding.

    Returns the model in a Step, the root, whose group also holds the model's own
    parameters (those in no block), in float32, as the units' gradients need. Its
    metrics() runs as a forward pass too (for evaluation). One process alone shards
    nothing: it trains the plain model in a Step, with the same checkpoints."""
    if dist.get_world_size() == 1:  # nothing to shard: the plain model, as fast
        return Step(build_model(args)).to(device)
    whole = build_model(args) if dist.get_rank() == 0 else None
    try:
        with torch.device("meta"):
            sharded = Step(build_model(args))
    except RuntimeError:  # a library refuses the meta device (from_pretrained)
        sharded = Step(build_model(args))  # a whole copy, until sharded
    for block in reversed(sharded_blocks(sharded.model)):  # inner blocks first
        fsdp.fully_shard(block, **precision(block, args))
    fsdp.fully_shard(sharded)
    fsdp.register_fsdp_forward_method(sharded, "metrics")
    sharded.to_empty(device=device)
    nn.init.zeros_(sharded.units)
    for name, buffer in sharded.model.named_buffers():  # whole on every rank
        if whole is not None:
            buffer.copy_(whole.get_buffer(name))
        dist.broadcast(buffer, src=0)
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    state = whole.state_dict() if whole else {}
    set_model_state_dict(sharded.model, state, options=options)
    return sharded


def sharded_blocks(model):
    """The modules sharded on their own: the blocks of every nn.ModuleList (such as a
    transformer's layers), else each child of the root that holds parameters but the
    last (the default model's layers), which the root keeps. Another rule for your
    model goes here."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if lists:
        return [block for blocks in lists for block in blocks]
    return [child for child in model.children() if list(child.parameters())][:-1]


def precision(module, args):
    """With --amp bf16: a block gathers its parameters in bfloat16, and returns and
    reduces in float32 (the root's dtype); not for BatchNorm, whose running
    statistics stay in float32."""
    batch_norm = nn.modules.batchnorm._BatchNorm
    if args.amp != "bf16" or any(isinstance(m, batch_norm) for m in module.modules()):
        return {}
    float32 = torch.float32
    policy = fsdp.MixedPrecisionPolicy(torch.bfloat16, float32, output_dtype=float32)
    return {"mp_policy": policy}


def local(tensor):
    """This rank's shard of a sharded tensor (a DTensor); a plain tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor
{%- endmacro %}

{% macro update_doc() %}
    """One optimizer update, after the backward pass of the last micro-batch (whose
    reduce-scatter, DDP change 3, averaged the gradients over the ranks: each rank
    holds its shard of them, and updates its shard of the parameters)."""
{%- endmacro %}

{% macro local_weights() %}
    weights = map(local, t.model.parameters())  # each rank checks its own
{%- endmacro %}

{% macro evaluate_batches() %}
    for batch, real in lockstep(loader, device):
        WATCH.beats += 1
        metrics = model.metrics(to_device(batch, device))
        if not real:
            continue
{%- endmacro %}

{% macro load_for_evaluation() %}
    torch.manual_seed(args.seed)  # the data build_datasets() makes for this seed
    _, val_set = checked_datasets(args)
    model = build_sharded(args, device)  # evaluated in the root of the sharding
    if path.is_dir():  # a checkpoint folder: its shards, resharded for this run
        saved = load_shared(path / "train_state.pt", device, "evaluate")
        frozen = frozen_as_built(model.model, saved, path)
        load_shards(model.model, None, path, "evaluate", frozen=frozen)
    else:
        saved = load_shared(path, device, "evaluate")
        weights = saved["model"] if "optimizer" in saved else saved
        load_weights(model.model, weights, path)
{%- endmacro %}

{% macro compile_flag() %}
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the sharded model"
    )
{%- endmacro %}

{% macro collectives() %}
# Where in torch a stack waits for the other ranks: collectives (FSDP2's all-gathers
# and reduce-scatters among them) and the backward pass (which reduce-scatters).
COLLECTIVES = ("torch/distributed/", "torch/autograd/")
{%- endmacro %}
