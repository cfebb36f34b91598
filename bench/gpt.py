"""A model that keeps a GPU busy, for the GPU half of the bench: a GPT-2-small-class
transformer on synthetic tokens, put into a copy of a generated project.

make_gpt_project() copies the project's main_multi_gpu.py and replaces four of the
functions a user edits (build_datasets, build_model, compute_loss, compute_metrics)
with a language model's, the way streams.py replaces build_datasets: the originals
are renamed (default_...), the new ones go before the `if __name__ == "__main__":`
guard. Every contender imports these functions from the copy (common.py), so all
train the same model on the same data; nothing else in the project changes.

Model FLOPs (for MFU) are counted as in the PaLM paper (Chowdhery et al. 2022,
appendix B): 6 x (weights of the matrix multiplications) per token for the forward and
backward passes, plus 12 x layers x width x sequence length per token for attention
(the full T x T score matrix, as if not causal). Layer norms, GELU, softmax and the
optimizer are not counted. tests/test_gpu_check.py compares this count with
torch.utils.flop_counter on the tiny size.
"""

from pathlib import Path

SIZES = {
    # GPT-2 small (124M with a tied head; the head is a separate matrix here, so 163M),
    # the vocabulary rounded up to a multiple of 64 as nanoGPT does.
    "gpt2-small": {
        "layers": 12,
        "heads": 12,
        "width": 768,
        "seq_len": 1024,
        "vocab": 50304,
    },
    # For a CPU smoke test.
    "tiny": {"layers": 2, "heads": 2, "width": 64, "seq_len": 32, "vocab": 256},
}

SOURCE = '''

# -- bench/gpt.py: a GPT-2-class language model on synthetic tokens -------------------
GPT = "CONFIG"


def build_datasets(args):
    """Random tokens; each item is (tokens, the same shifted by one)."""

    def make(size, part):
        generator = torch.Generator().manual_seed(1000 * args.seed + part)
        shape = (size, GPT["seq_len"] + 1)
        tokens = torch.randint(GPT["vocab"], shape, generator=generator)
        return TensorDataset(tokens[:, :-1].clone(), tokens[:, 1:].clone())

    return make(args.train_size, 1), make(args.val_size, 2)


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * width, width),
        )

    def forward(self, x):
        b, t, width = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, width // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, width))
        return x + self.mlp(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        width = GPT["width"]
        self.tokens = nn.Embedding(GPT["vocab"], width)
        self.positions = nn.Embedding(GPT["seq_len"], width)
        blocks = (Block(width, GPT["heads"]) for _ in range(GPT["layers"]))
        self.blocks = nn.ModuleList(blocks)  # FSDP2 shards each block on its own
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, GPT["vocab"], bias=False)  # not tied

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.tokens(tokens) + self.positions(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_model(args):
    return Transformer()


def compute_loss(model, batch):
    tokens, targets = batch
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
    return loss, targets.numel()


def compute_metrics(model, batch):
    tokens, targets = batch
    logits = model(tokens).flatten(0, 1).float()
    n = targets.numel()
    return {
        "loss": (F.cross_entropy(logits, targets.flatten(), reduction="sum"), n),
        "acc": ((logits.argmax(dim=1) == targets.flatten()).sum(), n),
    }
'''
REPLACED = ("build_datasets", "build_model", "compute_loss", "compute_metrics")
GUARD = '\n\nif __name__ == "__main__":'


def make_gpt_project(project, out_dir, size="gpt2-small"):
    """A copy of the project's main_multi_gpu.py training SIZES[size]; its folder."""
    source = (Path(project) / "main_multi_gpu.py").read_text()
    for name in REPLACED:
        if source.count(f"\ndef {name}(") != 1:
            raise SystemExit(f"error: {project}/main_multi_gpu.py is not as generated")
        source = source.replace(f"\ndef {name}(", f"\ndef default_{name}(")
    head, guard, tail = source.rpartition(GUARD)
    if not guard:
        raise SystemExit(f"error: {project}/main_multi_gpu.py has no __main__ guard")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    code = SOURCE.replace('"CONFIG"', repr(SIZES[size]))
    (out_dir / "main_multi_gpu.py").write_text(head + code + guard + tail)
    return out_dir


def matmul_weights(size):
    """Weights that take part in matrix multiplications (embeddings, norms and biases
    do not)."""
    c = SIZES[size]
    return c["layers"] * 12 * c["width"] ** 2 + c["width"] * c["vocab"]


def flops_per_token(size):
    """Model FLOPs of a forward and backward pass, per token (PaLM's count)."""
    c = SIZES[size]
    attention = 12 * c["layers"] * c["width"] * c["seq_len"]
    return 6 * matmul_weights(size) + attention
