{# parallelism=fsdp2: the checkpoint format under FSDP2 (how it is written, read and
   resumed), where ddp/checkpoints.py has its own version. Macros called by name
   from the section files (`{{ saving.load_checkpoint() }}`), as in training.py. #}
{% set ext = "" %}

{% macro last_path() %}
    last_path = out_dir / "checkpoint_last"  # a folder of every rank's shards
{%- endmacro %}

{% macro final_weights() %}
    # DDP change 4 (FSDP2): the whole model, gathered from every rank's shards into
    # rank 0's memory (every rank takes part), saved once, as one plain file.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(t.model, options=options)
{%- endmacro %}

{% macro remove_last_checkpoint() %}
    shutil.rmtree(out_dir / "checkpoint_last", ignore_errors=True)
{%- endmacro %}

{% macro save_checkpoints() %}
def save_checkpoints(t, at, names):
    """DDP change 4 (FSDP2): a checkpoint is a folder into which every rank writes its
    shards of the model and the optimizer (torch.distributed.checkpoint), and rank 0
    the rest of the state (train_state.pt). It is written as NAME.tmp, renamed once
    complete: a folder under its own name is always whole."""
    state = snapshot(t, at)
    optimizers = list(t.optimizers.values())
    shards = dict(zip(("model", "optimizer"), get_state_dict(t.model, optimizers)))
    frozen = state["frozen"]  # left out: see left_out
    shards["model"] = {k: v for k, v in shards["model"].items() if k not in frozen}
    out_dir = Path(t.args.output_dir)
    tmp = out_dir / f"{names[0]}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # what a crash left
        tmp.mkdir(parents=True)
    dist.barrier()  # before anyone writes into it
    try:
        dcp.save(shards, checkpoint_id=tmp, planner=RANK_0_WRITES_REPLICAS)
    except dcp.CheckpointException as err:  # a rank's write failed: all say so
        shutil.rmtree(tmp, ignore_errors=True)  # (its room back: the disk may be full)
        errors = [error for error, _ in err.failures.values()]  # each failed rank's
        error = next((e for e in errors if isinstance(e, OSError)), errors[0])
        raise cannot_write(out_dir / names[0], error) from None
    by_rank_0(t.device, commit, state, tmp, [out_dir / name for name in names])


def commit(state, tmp, paths):
    """Rank 0: the rest of the state into the folder `tmp`, which then takes the
    place of each path (a copy for all but the first)."""
    save_atomic(state, tmp / "train_state.pt")
{% if strategy in ("best", "every_epoch") %}
    for path in paths[1:]:  # the same checkpoint under another name: a copy
        copy = path.with_name(f"{path.name}.tmp")
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(tmp, copy)
        replace_folder(copy, path)
{% endif %}
    replace_folder(tmp, paths[0])


def replace_folder(new, path):
    """Put the folder `new` in `path`'s place. The old one moves aside first (as
    NAME.old, which load_checkpoint takes if a crash comes between the two renames)."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(new, path)
    shutil.rmtree(old, ignore_errors=True)
{%- endmacro %}

{% macro snapshot_tensors() %}
        # The model's and the optimizer's tensors: every rank's shards, beside this.
        "optimizer": packed(
            {
                k: {"param_groups": o.state_dict()["param_groups"]}
                for k, o in t.optimizers.items()
            }
        ),
{%- endmacro %}

{% macro load_checkpoint() %}
def load_checkpoint(resume, last_path, device):
    """Return the checkpoint to resume from (its train_state.pt, and the folder's
    path for the shards), or None to start fresh. Every rank reads the same folder:
    FSDP2's checkpoints need a disk that every machine sees."""
    path = last_path if resume == "auto" else Path(resume)
    moved_aside = path.with_name(path.name + ".old")  # see replace_folder()
    if resume == "auto" and not path.exists() and moved_aside.exists():
        path = moved_aside
    wanted = resume != "never" and (resume != "auto" or path.exists())
    state = path / "train_state.pt"
    # What a resume reads (the checkpoints of other versions of this file may differ)
    keys = ["optimizer", "scheduler", "scaler", "train_sums", "global_batch", "args"]
    keys += ["total_updates", "stream_shards", *asdict(Position())]
    checkpoint = load_shared(state if wanted else None, device, "resume from", keys)
    return None if checkpoint is None else checkpoint | {"path": str(path)}


def load_shards(model, optimizer, path, verb, advice="", frozen=()):
    """FSDP2: the model's (and the optimizer's, if given) shards from a checkpoint
    folder, resharded for this run's number of ranks; one line if they do not fit.
    The `frozen` parameters it left out keep the model's own (see frozen_as_built)."""
    if optimizer is None:
        shards = {"model": get_model_state_dict(model)}
    else:
        shards = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))
    saved = {k: v for k, v in shards["model"].items() if k not in frozen}
    try:
        dcp.load(shards | {"model": saved}, checkpoint_id=path)  # into the same tensors
    except Exception as err:  # DCP wraps every rank's error in one
        reason = [line for line in str(err).splitlines() if "Error" in line]
        reason = (reason or [repr(err)])[-1].split("Error: ")[-1].strip()
        raise failure(
            f"error: cannot {verb} {path}: it does not fit the model build_model() "
            f"makes ({reason}){advice}"
        ) from err
    if optimizer is None:
        set_model_state_dict(model, shards["model"])
    else:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=shards["model"],
            optim_state_dict=shards["optimizer"],
        )
{%- endmacro %}

{% macro load_state() %}
        missing = sorted(set(model.state_dict()) - set(weights))
        if missing:  # set_model_state_dict() would keep the model's own values
            raise RuntimeError(f"Missing key(s) in state_dict: {', '.join(missing)}")
        options = StateDictOptions(full_state_dict=True)  # into the shards
        set_model_state_dict(model, weights, options=options)
{%- endmacro %}

{% macro resume_tensors() %}
        optimizers, path = list(t.optimizers.values()), checkpoint["path"]
        frozen = frozen_as_built(t.model, checkpoint, path, advice)
        load_shards(t.model, optimizers, path, "resume from", advice, frozen)
{%- endmacro %}
