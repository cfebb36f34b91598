class LossSums:
    """This rank's training loss since the last evaluation, summed over units, and
    the units, on the device; and each micro-batch's (loss, n) since then, which fold()
    adds up at each check, all at once: no tensor work a step. The check adds the
    sums up over the ranks, as `reduced`, and their mean, `so_far`: what an
    evaluation's row and a checkpoint take."""

    def __init__(self, device, carried=(0.0, 0.0)):
        self.sums = torch.tensor(carried, dtype=torch.float64).to(device)  # loss, units
        self.recent = []  # (loss detached, n) per micro-batch: train_pass() appends
        # train_pass() sets .epoch and .next_step: the pass and micro-batch of recent[0]

    def fold(self):
        """Add the recent micro-batches to the sums; return their losses (float32).
        Its one caller, the check after an update, has one at least."""
        loss, ns = zip(*self.recent)
        self.recent, loss = [], torch.stack(loss).double()  # each micro-batch's
        to = functools.partial(torch.as_tensor, dtype=loss.dtype, device=loss.device)
        units = torch.stack([*map(to, ns)]) if any(map(torch.is_tensor, ns)) else to(ns)
        self.sums += torch.stack([loss @ units, units.sum()])
        return loss.float()


class Step(nn.Module):
    """{{ par.step_host }}: the model, and a training step (compute_loss) as
    the forward pass, so that {{ par.step_sees }} every parameter a step uses; and `units`,
    a parameter, zero: each micro-batch adds its column 0's sum to its loss (so that
    its gradient is the loss's weight, n / batch size), and an update's last its
    column 1's sum, unweighted, where this rank has items after it of a stream read by
    shard (`more`): the gradients' reduction brings the mean weight per rank, and the
    mean `more` (in each row: one per rank, so that FSDP2 shards it evenly)."""

    no_sync = contextlib.nullcontext  # alone (not in DDP): no all-reduce to skip

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.units = nn.Parameter(torch.zeros(dist.get_world_size(), 2))

    def forward(self, batch, real, turn, more=False):
        """compute_loss's (loss, n) for one micro-batch, and what its units add."""
        out = compute_loss(self.model, batch, *turn)
        loss, n = out if isinstance(out, tuple) and len(out) == 2 else (None, 0)
        if not (torch.is_tensor(loss) and loss.dim() == 0):
            expected = "(loss, n): the mean loss over n units, a tensor of shape ()"
            raise returned("compute_loss", out, expected)
        n = n if real else 0  # a stand-in batch at a stream's end weighs nothing
        ahead = self.units[:, 1].sum() if more else None  # apart from the weight
        return loss, n, self.units[:, 0].sum(), ahead
{% if fsdp %}

    def metrics(self, batch):
        """compute_metrics for one batch (a forward pass: see build_sharded)."""
        return compute_metrics(self.model, batch)

    def set_requires_gradient_sync(self, sync):
        """Alone (one process, nothing sharded: see build_sharded): nothing to reduce.
        (Sharded, FSDP2's own method takes this one's place.)"""
{% endif %}


def update(t, turn):
{{ par.update_doc() }}
    args, names = t.args, turn or tuple(t.optimizers)  # the turn's, or all
    optimizers = [t.optimizers[name] for name in names]
    params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    # The gradients are of losses weighted by n / batch size, averaged over ranks:
    # divide them by the mean weight per rank (over all ranks), so that every update
    # follows the mean loss over all units of the global batch, for any processes and
    # --grad-accum. Row 0: the mean weight, and > 0 where some rank has stream items
    # after this update.
{% if fsdp %}
    t.units = units = local(t.sharded.units.grad)  # reduce-scattered: its row
{% else %}
    t.units = units = t.step.units.grad  # every row alike (train_pass)
{% endif %}
    for optimizer in optimizers:  # --amp fp16: the true gradients, for clipping
        t.scaler.unscale_(optimizer)
    grads = [p.grad for p in params if p.grad is not None]
    if not t.alone:  # (alone: the micro-batch's weight was left out, see backward())
        torch._foreach_div_(grads, units[0, 0].clamp(min=1e-12))  # 0 / 0: 0
    if args.clip_grad_norm:
        nn.utils.clip_grad_norm_(params, args.clip_grad_norm)
    for optimizer in optimizers:
        t.scaler.step(optimizer)  # skipped when fp16 gradients overflowed
    t.scaler.update()
    for param in t.trained:  # every one: a turn's loss reaches others' too
        param.grad = None  # (faster than zero_grad(), which walks every module)
    for scheduler in filter(None, map(t.schedulers.get, names)):  # those not None
        scheduler.step()


def check(t):
    """The loop's one wait for the device, every LOG_EVERY updates and before every
    evaluation and save: every rank learns whether any rank got SIGTERM (returns
    True), or saw a loss or weights that are not finite (then the run stops, saving
    nothing)."""
    recent = t.sums.fold()  # this rank's losses since the last check
{{ par.local_weights() }}
    finite = torch.stack([each.isfinite().all() for each in (recent, *weights)]).all()
    flags = torch.stack([finite.new_tensor(STOP_SIGNAL is not None), ~finite]).double()
    flags = torch.cat([flags, t.sums.sums])  # and the loss so far (see LossSums)
    dist.all_reduce(flags)
    stop, diverged, loss_sum, units = flags.tolist()
    if diverged:
        raise diverged_failure(recent, t.sums.next_step, t.sums.epoch + 1, t.device)
    t.sums.next_step += len(recent)
    t.sums.reduced = loss_sum, units  # over all ranks (see LossSums)
    t.sums.so_far = loss_sum / units if units else math.nan
    return stop > 0


def diverged_failure(recent, first_step, epoch, device):
    """The error for a loss or weights that stopped being finite: the first such step
    over all ranks, with its rank and value. recent[0] is the pass's micro-batch
    first_step (counted from 0); epoch is the pass's number (from 1)."""
    bad = (~torch.isfinite(recent)).nonzero().flatten().tolist()
    first = (math.inf, dist.get_rank(), 0.0)  # this rank's: (batch, rank, loss)
    if bad:  # the batch counted from 1, as the line says it
        first = (first_step + bad[0] + 1, dist.get_rank(), recent[bad[0]].item())
    # The first over all ranks (the lowest rank's, of those at the same batch)
    step, rank, value = min(map(pickle.loads, gathered(pickle.dumps(first), device)))
    where = f"the weights stopped being finite in epoch {epoch}"
    if math.isfinite(step):
        where = f"the loss is {value} in epoch {epoch} at batch {step} (rank {rank})"
    advice = "Try a lower --lr, --clip-grad-norm 1.0, or --amp bf16 instead of fp16"
    return failure(f"error: {where}; stopped without saving it. {advice}")


def stopped(last_path, at, batch_size):
    """After the checkpoint a stop signal asked for: one line, and the exit status."""
    # The signal this rank got; a rank stopped by another's signal reports SIGTERM.
    signum = STOP_SIGNAL or signal.SIGTERM
    words = {signal.SIGINT: "interrupted", signal.SIGHUP: "hung up"}
    word = words.get(signum, "preempted")
    again = "run again to resume (--resume auto)"
{% if multi and not spawn %}
    if word == "preempted" and "ELASTIC_ROUND" in os.environ:  # a round that changes
        again = "the next elastic round resumes from it, or the same command again"
{% endif %}
    print0(f"{word}: saved {last_path} {where(at, batch_size)}; {again}")
    return 128 + signum


def where(at, batch_size):
    """A position as the run's lines say it: "after epoch 2", "in epoch 3 after 20
    batches" (each process's batches, --batch-size each: with --grad-accum 2, two
    batches make an optimizer update)."""
    if not at.epoch_samples:
        return f"after epoch {at.epoch}"
    batches = at.epoch_samples // (batch_size * dist.get_world_size())
    return f"in epoch {at.epoch + 1} after {batches} batch{'es' * (batches != 1)}"


@torch.no_grad()
def run_validation(model, loader, device):
    """compute_metrics over the whole validation set, exact for any world size: each
    metric's sum and n are added up over batches and ranks, then divided."""
    model.eval()
    sums, zero = {}, torch.zeros(2, dtype=torch.float64, device=device)  # [sum, n]
{{ par.evaluate_batches() }}
        ok = isinstance(metrics, Mapping) and "loss" in metrics
        ok = ok and all(type(p) is tuple and len(p) == 2 for p in metrics.values())
        if not ok:
            raise returned("compute_metrics", metrics, "{'loss': (sum, n), ...}")
        for name, (total, n) in metrics.items():
            both = sums.setdefault(name, zero.clone())
            both[0] += total
            both[1] += n
    model.train()
    # Rank 0 has validation data unless there is none; a rank without any takes its
    # names.
    names = broadcast_bytes("\n".join(sums).encode(), device).decode().split("\n")
    if names == [""]:
        raise failure("error: build_datasets() returned an empty validation stream")
    totals = torch.stack([sums.get(name, zero) for name in names])
    dist.all_reduce(totals)  # sum over ranks
    return {k: s / n if n else math.nan for k, (s, n) in zip(names, totals.tolist())}


{% if fsdp %}
def lockstep(loader, device):
    """FSDP2: this rank's validation batches as (batch, real), where each forward
    gathers the parameters from every rank: so every rank takes as many as the rank
    with the most, the others padding with stand-ins (real False) that count nothing."""
    if isinstance(loader, StreamLoader):  # a stream: until no rank has more
        for batch, real, _, more, _ in loader:
            yield batch, real
            more = torch.tensor(float(more), device=device)
            dist.all_reduce(more)
            if not more.item():
                return
        return
    shard = loader.dataset  # every world_size-th sample of the set, from this rank's
    most = math.ceil(len(shard.dataset) / dist.get_world_size())  # rank 0's
    batch = None
    for batch in loader:
        yield batch, True
    if batch is None:  # fewer samples than ranks: this one has none
        batch = loader.collate_fn([shard.dataset[0]])
    for _ in range(math.ceil(most / loader.batch_size) - len(loader)):
        yield batch, False


{% endif %}
def evaluate_saved(args, device):
    """--evaluate PATH: the exact evaluation above, on every rank, of the weights in
    PATH (model_final.pt, or a checkpoint's); one line of metrics, nothing written."""
    path = Path(args.evaluate)
{{ par.load_for_evaluation() }}
    metrics = run_validation(model, build_val_loader(val_set, args, device), device)
    print0(f"evaluate {path}  {one_line(metrics, 'val_')}")


def one_line(values, prefix=""):
    """name value pairs as a run's lines show them: "val_loss 2.3  val_acc 0.1"."""
    return "  ".join(f"{prefix}{name} {value:.6g}" for name, value in values.items())


