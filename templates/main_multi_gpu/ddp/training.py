{# parallelism=ddp: how the model trains under DDP, where fsdp2/training.py has
   its own version. Macros, called by name from the section files
   (`{{ par.train_step() }}`), in the order the generated file uses them; fsdp2/
   defines the same names. A macro's text is exactly the lines it stands for: its
   last newline comes from the line that calls it. #}
{# Names the section files use: the module train_pass() calls train(), and where
   the Step module that holds the model sits. #}
{% set wrapper, step_host, step_sees = (
    "ddp_model", "The module DDP wraps", "DDP sees"
) %}

{% macro intro() %}
# Data-parallel training with PyTorch DistributedDataParallel (DDP): one process per GPU
# (or two on CPU), each training a replica of the model on its share of every batch.
# The four changes from a single-GPU script are marked "DDP change N":
#   1. join the process group described by the launcher's environment
#   2. a DistributedSampler shards the data, and set_epoch reshuffles it every epoch
#   3. the model is wrapped in DDP, which averages gradients across processes
#   4. only rank 0 prints and saves (the plain model, not the DDP wrapper)
{%- endmacro %}

{% macro docstring() %}
"""Train a model with DistributedDataParallel, on one machine or several."""
{%- endmacro %}

{% macro build_model_doc() %}
    """Return the plain model (DDP wraps it later). Its normalization layers are
    written inline, nn.BatchNorm2d(C), so they are easy to find and swap."""
{%- endmacro %}

{% macro compute_loss_doc() %}
    `model` is your model (compiled with --compile), called inside DDP's forward pass
    (with more than one process), so that DDP sees which parameters a step uses.
{%- endmacro %}

{% macro compute_metrics_doc() %}
    `model` is the plain model (not DDP, not compiled), in eval mode, without grad
    and without --amp's autocast.
{%- endmacro %}

{% macro constants() %}
CHANNELS_LAST = True  # on GPUs, 2-D convolutions in NHWC: faster
{%- endmacro %}

{% macro training_fields() %}
    - model: the plain model: saved (DDP change 4), and evaluated
    - step: the model in a Step (with compute_loss); ddp_model: the Step in the DDP
      wrapper (DDP change 3), or the Step itself in a run of one process: trained
{%- endmacro %}

{% macro train_step() %}
    # DDP change 3: the gradient all-reduce runs in the backward pass of the last
    # micro-batch of each update only; no_sync() skips it for the others.
    with contextlib.nullcontext() if sync else t.ddp_model.no_sync():
        # Without --amp no autocast context at all: a disabled one costs time too
        with torch.autocast(device.type, amp) if amp else contextlib.nullcontext():
            loss, n, units, ahead = t.ddp_model(batch, real, turn, more)  # see Step
        # The loss summed over the batch's n units, at the usual scale (times n / batch
        # size, left out where that is 1: a per-sample loss); update() divides by the
        # mean weight, which the gradients' reduction brings (`units`, `ahead`: zero).
        # Alone, that weight would cancel: left out, unless a stand-in's (0).
        total = t.scaler.scale(loss) + units
        if not (t.alone and real) and (torch.is_tensor(n) or n != args.batch_size):
            total = total * (n / args.batch_size)
        (total if ahead is None else total + ahead).backward()
    if sync:
        check_reduced(t)
{%- endmacro %}

{% macro evaluation_comment() %}
        # Evaluate the weights rank 0 saves: parameters match on every rank, but
        # each rank keeps its own BatchNorm running statistics, so take rank 0's.
        # Use the plain model: DDP's forward would wait for ranks with more
        # validation batches.
{%- endmacro %}

{% macro build_training_doc() %}
    """Data, model, DDP wrapper, optimizer and loss scaler, as build_* say."""
{%- endmacro %}

{% macro wrap_model() %}
    t.model = model = build_model(args)
{% if cookiecutter.sync_bn %}
    if device.type == "cuda":
        # DDP change 3a: BatchNorm statistics over the global batch, not per rank.
        t.model = model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    elif dist.get_world_size() > 1:  # (one process has nothing to synchronise)
        print0(
            "warning: SyncBatchNorm runs on GPUs only; training with BatchNorm on CPU",
            file=sys.stderr,
        )
{% endif %}
    # On GPUs, NHWC weights for 2-D convolutions (which convert their input to
    # match); models with 5-D weights (3-D convolutions) keep their layout.
    flat = all(p.dim() < 5 for p in model.parameters())
    nhwc = CHANNELS_LAST and device.type == "cuda" and flat
    model.to(device, memory_format=torch.channels_last if nhwc else None)
    t.optimizers, t.schedulers = named(build_optimizer(model, args, t.total_updates))

    # DDP change 3: wrap the model. Its backward pass averages gradients over all ranks,
    # so every replica takes the same optimizer step. Train through ddp_model; save
    # and evaluate the plain model, whose parameters ddp_model trains.
    # torch.compile inside DDP: the compiled graph is split at DDP's gradient buckets,
    # so the all-reduce still overlaps with the backward pass.
    t.step = t.ddp_model = Step(torch.compile(model) if args.compile else model)
    t.step.to(device)
    if dist.get_world_size() > 1:  # (alone, one process has nothing to average)
        t.ddp_model = DDP(
            t.step,
            device_ids=[device.index] if device.type == "cuda" else None,
            gradient_as_bucket_view=True,
            find_unused_parameters=FIND_UNUSED_PARAMETERS,
        )
{% if cookiecutter.sync_bn %}
        # Rank 0's buffers to the others before each forward pass, but SyncBatchNorm's,
        # which are equal already. (An attribute: torch 2.13 deprecates the argument,
        # which older versions need.)
        t.ddp_model.broadcast_buffers = device.type != "cuda"
{% endif %}
    t.trained = list(t.step.parameters())  # the model's, and the Step's units
    # What evaluation, --evaluate and the final weights use: the model, or what
    # build_optimizer() named with keep(..., evaluate=) (an EMA's average).
    t.evaluated = next((e for _, e in KEPT.values() if e is not None), model)
    return t


def check_reduced(t):
    """After an update's backward pass: every parameter trained got a gradient, or one
    line names those the step left out, and what to set (under DDP, its own error would
    come one step later, as a wall of text; alone, training would go on, until DDP's
    error with more processes)."""
    unused = [p.grad is None and p.requires_grad for p in t.trained]
    if FIND_UNUSED_PARAMETERS or not any(unused):
        return
    names = [name for (name, _), u in zip(t.step.named_parameters(), unused) if u]
    left = re.sub(r"(^|, )model\.", r"\1", ", ".join(names)).replace("_orig_mod.", "")
    raise failure(
        f"error: the step left {left} out of its loss: set "
        "FIND_UNUSED_PARAMETERS = True at the top of this file (or freeze them "
        "with requires_grad_(False))"
    )
{%- endmacro %}

{% macro update_doc() %}
    """One optimizer update, after the backward pass of the last micro-batch (whose
    all-reduce, DDP change 3, averaged the gradients over the ranks)."""
{%- endmacro %}

{% macro local_weights() %}
    weights = t.model.parameters()
{%- endmacro %}

{% macro evaluate_batches() %}
    for batch in loader:
        WATCH.beats += 1
        metrics = compute_metrics(model, to_device(batch, device))
{%- endmacro %}

{% macro load_for_evaluation() %}
    saved = load_shared(path, device, "evaluate")
    torch.manual_seed(args.seed)  # the data build_datasets() makes for this seed
    _, val_set = checked_datasets(args)
    model = build_model(args).to(device)
    if "optimizer" in saved:  # a checkpoint: the weights its evaluation used
        own = frozen_as_built(model, saved, path)  # what it left out (see left_out)
        saved = saved.get("evaluated") or own | saved["model"]  # see keep()
    load_weights(model, saved, path)
{%- endmacro %}

{% macro compile_flag() %}
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the model inside DDP"
    )
{%- endmacro %}

{% macro collectives() %}
# Where in torch a stack waits for the other ranks: collectives, DDP's forward (it
# broadcasts buffers) and the backward pass (whose hooks all-reduce gradients).
COLLECTIVES = ("torch/distributed/", "torch/nn/parallel/", "torch/autograd/")
{%- endmacro %}
