{# parallelism=ddp: the checkpoint format under DDP (how it is written, read and
   resumed), where fsdp2/checkpoints.py has its own version. Macros called by name
   from the section files (`{{ saving.load_checkpoint() }}`), as in training.py. #}
{% set ext = ".pt" %}

{% macro last_path() %}
    last_path = out_dir / "checkpoint_last.pt"
{%- endmacro %}

{% macro final_weights() %}
    # DDP change 4: the plain model's weights (not the DDP wrapper's), saved once.
    weights = t.model.state_dict()
{%- endmacro %}

{% macro remove_last_checkpoint() %}
    (out_dir / "checkpoint_last.pt").unlink(missing_ok=True)
{%- endmacro %}

{% macro save_checkpoints() %}
def save_checkpoints(t, at, names):
    """DDP change 4: rank 0 alone saves, the state at `at` under each name. (Every
    rank calls it: a stream's states are gathered from every rank, see snapshot.)"""
    state = snapshot(t, at)
    for name in names:
        by_rank_0(t.device, save_atomic, state, Path(t.args.output_dir) / name)
{%- endmacro %}

{% macro snapshot_tensors() %}
        # DDP change 4: the plain model (not the DDP wrapper, nor torch.compile's), so
        # the weights load without either and without a "module." prefix in keys.
        "model": {k: v for k, v in t.model.state_dict().items() if k not in frozen},
        "optimizer": packed({k: o.state_dict() for k, o in t.optimizers.items()}),
        # The weights evaluation uses, where keep() named others (for --evaluate).
        "evaluated": None if t.evaluated is t.model else t.evaluated.state_dict(),
{%- endmacro %}

{% macro load_checkpoint() %}
def load_checkpoint(resume, last_path, device):
    """Return the checkpoint to resume from, or None to start fresh."""
    path = last_path if resume == "auto" else Path(resume)
    wanted = resume != "never" and (resume != "auto" or path.exists())
    # What a resume reads (the checkpoints of other versions of this file may differ)
    keys = ["model", "optimizer", "scheduler", "scaler", "train_sums", "global_batch"]
    keys += ["total_updates", "args", "stream_shards", *asdict(Position())]
    checkpoint = load_shared(path if wanted else None, device, "resume from", keys)
    return None if checkpoint is None else checkpoint | {"path": str(path)}
{%- endmacro %}

{% macro load_state() %}
        model.load_state_dict(weights)
{%- endmacro %}

{% macro resume_tensors() %}
        own = frozen_as_built(t.model, checkpoint, checkpoint["path"], advice)
        load_weights(t.model, own | checkpoint["model"], checkpoint["path"], advice)
        for name, state in unpacked(t, checkpoint["optimizer"]).items():
            t.optimizers[name].load_state_dict(state)
{%- endmacro %}
