"""Training a small transformer with flashgen's attention tracks the same training with SDPA.

A pre-norm decoder (token + position embeddings, 2 blocks of causal self-attention + GELU MLP,
final LayerNorm and a vocabulary head) with float32 master weights under bf16 autocast, AdamW,
batch 4, on a fixed batch of token sequences made of a random 64-token block repeated (so the
loss can fall within a few steps, and attention has something to copy). It is built once from a
fixed seed and copied, then trained for STEPS steps twice from the same weights and data: once
with ``flashgen.flash_attn_func`` (q, k, v are strided slices of the packed qkv projection, used
in place) and once with ``torch.nn.functional.scaled_dot_product_attention`` (default backend).
A third copy takes one step in float32 with SDPA's math backend: the reference gradients.

Asserted, for head_dim 64 (d_model 256, seqlen 512) and head_dim 128 (d_model 512, seqlen 256):

* First-step gradients, FA3's rule at the model level: for every parameter,
  ``|g_flashgen - g_ref| <= 2 |g_sdpa - g_ref| + GRAD_FLOOR`` in relative Frobenius norm
  (``|a - b| / |b|``). Both bf16 runs share the same autocast rounding outside attention, so a
  correct backward lands at about SDPA's error; an error in dQ, dK or dV reaches the qkv
  projection's gradient directly (it is X^T [dQ dK dV]) and every earlier parameter through it.
* Losses: at every step ``|loss_flashgen - loss_sdpa| <= LOSS_RTOL * loss_sdpa``.
* The loss decreases: the last step's is below DECREASE x the first's, for both runs.

Tolerances. Calibrated on the CPU (bf16 autocast there too) with flashgen's attention replaced by
an exact stand-in: float32 math on the upcast inputs, out and dQ/dK/dV rounded once to bf16 (what
FA3's kernels approximate), against SDPA in bf16, seeds 1234 and 7, both configurations:

* the per-step loss difference stayed below 0.09 % (LOSS_RTOL = 2 % leaves > 20x margin);
* first-step gradient errors against float32 were 2e-3 .. 5e-3 for both runs, the ratio
  flashgen/SDPA at most 1.05 over all parameters (the rule allows 2, plus GRAD_FLOOR = 2e-3);
  with dK scaled by 1.05 (a planted bug) the qkv weights' error rose to 1.4e-2 .. 1.6e-2 and
  the rule failed, while the losses still agreed to 0.005 %: the loss curve alone cannot see a
  wrong backward, the gradient rule can;
* the loss fell to 0.33 (head_dim 64) and 0.03 (head_dim 128) of its first value in 8 steps
  (DECREASE = 0.7).

On the GPU, flashgen and SDPA's flash/cuDNN kernels both round P to bf16 before the P V and
P^T dO products, so their errors are alike again.

Packed documents (``test_packed_documents_training_tracks_sdpa``, FA3's varlen training): each batch row cut into
documents of seeded random lengths (5 cuts), causal attention within each, flashgen through
``flash_attn_varlen_func`` on the varlen kernels both ways (the varlen backward, bwd.cu.j2 kVarlen), SDPA with the
per-document causal mask; the same rules. Calibrated on the CPU the same way (tests/test_gpu_logic_on_cpu.py runs
it on the emulated kernels): losses within 0.03 %, falling to 0.32 (hd64) and 0.03 (hd128) of the first, gradient
errors at most 1.4x SDPA's; dK scaled by 1.05 made the qkv weights' error 1.4e-2 .. 1.5e-2 and failed the rule.

Skipped without an sm_90 GPU (conftest.py) or when the forward or backward variant for bf16 at the
head dim, causal, is not built (reason MISSING-BWD-VARIANT / MISSING-FWD-VARIANT).
"""

from __future__ import annotations

import copy
import math

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import flashgen  # noqa: E402

from _ref import variant_missing, varlen_kernels_on  # noqa: E402  (tests/gpu is on sys.path: conftest.py)

pytestmark = pytest.mark.gpu

VOCAB = 512
BATCH = 4
LAYERS = 2
PERIOD = 64  # the repeated block's length
STEPS = 8
LR = 1e-3
# (d_model, head_dim, seqlen): 4 heads each
CONFIGS = [(256, 64, 512), (512, 128, 256)]

# Per-step relative loss difference allowed between the flashgen and SDPA runs (seen: < 0.09 %).
LOSS_RTOL = 0.02
# Absolute floor of the first-step gradient rule (relative-norm units), for parameters whose
# gradient both bf16 runs get almost exactly (the bound would otherwise be ~0).
GRAD_FLOOR = 2e-3
# The last step's loss is below this fraction of the first's, both runs (seen: 0.33 and 0.03).
DECREASE = 0.7


class Block(nn.Module):
    """Pre-norm transformer block: x + proj(attn(LN(x))), then x + MLP(LN(x)) (4x, GELU)."""

    def __init__(self, d_model: int, head_dim: int):
        super().__init__()
        self.heads, self.head_dim = d_model // head_dim, head_dim
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)
        self.fc1, self.fc2 = nn.Linear(d_model, 4 * d_model), nn.Linear(4 * d_model, d_model)

    def forward(self, x, attn):
        """x (batch, seqlen, d_model); attn(q, k, v) -> out, all (batch, seqlen, heads, head_dim), causal."""
        b, s, dm = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, self.head_dim).unbind(2)
        x = x + self.proj(attn(q, k, v).reshape(b, s, dm))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyLM(nn.Module):
    """Token + learned position embeddings, LAYERS blocks, final LayerNorm, vocabulary head."""

    def __init__(self, d_model: int, head_dim: int, seqlen: int):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(0.02 * torch.randn(seqlen, d_model))
        self.blocks = nn.ModuleList(Block(d_model, head_dim) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, VOCAB, bias=False)

    def forward(self, tokens, attn):
        """tokens int64 (batch, seqlen) -> logits (batch, seqlen, VOCAB)."""
        x = self.emb(tokens) + self.pos[: tokens.shape[1]]
        for blk in self.blocks:
            x = blk(x, attn)
        return self.head(self.ln_f(x))


def flashgen_attention(q, k, v):
    return flashgen.flash_attn_func(q, k, v, causal=True)


def sdpa_attention(q, k, v):
    """SDPA on BHSD views of the BSHD tensors (as a user calls it), back to BSHD."""
    out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), is_causal=True)
    return out.transpose(1, 2)


def make_batch(seqlen: int, seed: int = 0, device="cuda"):
    """int64 (BATCH, seqlen + 1): per row a random PERIOD-token block repeated."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    block = torch.randint(VOCAB, (BATCH, PERIOD), generator=g)
    reps = -(-(seqlen + 1) // PERIOD)
    return block.repeat(1, reps)[:, : seqlen + 1].to(device)


def train(model, attn, tokens, steps: int, autocast: bool = True):
    """``steps`` AdamW steps on the one batch (next-token cross-entropy, logits in float32).
    Returns (losses as floats, first step's gradients by parameter name)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads0 = [], None
    for i in range(steps):
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens[:, :-1], attn)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if i == 0:
            grads0 = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses).tolist(), grads0


def rel_err(a, ref) -> float:
    """|a - ref| / |ref| in Frobenius norm (float64)."""
    return ((a.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


def need_variants(head_dim: int) -> None:
    """Skip unless the bf16 causal forward and backward variants of head_dim are built."""
    key = {"dtype": "bf16", "head_dim": head_dim, "causal": True}
    for family, k in (("fwd", {**key, "head_dim_v": head_dim}), ("bwd", key)):
        why = variant_missing(family, k)
        if why:
            pytest.skip(why)


def reference_grads(base, attn, tokens):
    """First-step gradients of a float32 copy of ``base`` with ``attn`` under SDPA's math backend, TF32 off."""
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            return train(copy.deepcopy(base), attn, tokens, 1, autocast=False)[1]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.parametrize("d_model,head_dim,seqlen", CONFIGS, ids=[f"hd{c[1]}_d{c[0]}_s{c[2]}" for c in CONFIGS])
def test_training_tracks_sdpa(d_model, head_dim, seqlen):
    need_variants(head_dim)
    torch.manual_seed(1234)
    base = TinyLM(d_model, head_dim, seqlen).cuda()
    tokens = make_batch(seqlen)
    loss_fg, g_fg = train(copy.deepcopy(base), flashgen_attention, tokens, STEPS)
    loss_sd, g_sd = train(copy.deepcopy(base), sdpa_attention, tokens, STEPS)
    assert_tracks(f"hd{head_dim}", loss_fg, g_fg, loss_sd, g_sd, reference_grads(base, sdpa_attention, tokens))


def assert_tracks(tag: str, loss_fg, g_fg, loss_sd, g_sd, g_ref) -> None:
    """The module docstring's rules: finite losses, first-step gradients by FA3's rule at the model level against
    ``g_ref``, per-step losses within LOSS_RTOL of SDPA's, and falling below DECREASE x the first."""
    report = "\n".join(f"step {i}: flashgen {a:.5f}  sdpa {b:.5f}" for i, (a, b) in enumerate(zip(loss_fg, loss_sd)))
    assert all(math.isfinite(x) for x in loss_fg + loss_sd), f"non-finite loss:\n{report}"

    bad, ratios = [], {}
    for name, ref in g_ref.items():
        e_fg, e_sd = rel_err(g_fg[name], ref), rel_err(g_sd[name], ref)
        ratios[name] = (e_fg, e_sd)
        if not e_fg <= 2 * e_sd + GRAD_FLOOR:
            bad.append(f"{name}: |g - g_ref|/|g_ref| flashgen {e_fg:.2e} > 2 x sdpa's {e_sd:.2e} + {GRAD_FLOOR}")
    worst = max(abs(a - b) / b for a, b in zip(loss_fg, loss_sd))
    top = sorted(ratios.items(), key=lambda kv: -kv[1][0] / max(kv[1][1], 1e-30))[:3]
    print(f"\n[{tag}] loss flashgen {loss_fg[0]:.4f} -> {loss_fg[-1]:.4f}, sdpa {loss_sd[0]:.4f} -> "
          f"{loss_sd[-1]:.4f}; worst step difference {worst:.3%}; first-step gradient error vs float32, "
          "largest flashgen/sdpa ratios: " + ", ".join(f"{n} {a:.2e}/{b:.2e}" for n, (a, b) in top))
    assert not bad, "first-step gradients off:\n" + "\n".join(bad)

    assert worst <= LOSS_RTOL, f"losses differ by up to {worst:.2%} (> {LOSS_RTOL:.0%}):\n{report}"
    for name, losses in (("flashgen", loss_fg), ("sdpa", loss_sd)):
        assert losses[-1] < DECREASE * losses[0], f"{name}: loss did not fall below {DECREASE} x the first:\n{report}"


def doc_lengths(seqlen: int, seed: int) -> list:
    """Per batch row, the lengths of the documents packed into its ``seqlen`` tokens: seeded random cuts, so that
    some documents span several 64- and 128-row blocks and some are a few tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(BATCH):
        cuts = sorted(set(torch.randint(1, seqlen, (5,), generator=g).tolist()))
        rows.append([b - a for a, b in zip([0] + cuts, cuts + [seqlen])])
    return rows


def flashgen_docs_attention(lens: list):
    """Causal attention within each packed document: flash_attn_varlen_func over the batch's rows flattened
    (q, k, v strided views of the qkv projection), documents as its sequences."""
    flat = [n for row in lens for n in row]
    cu = torch.tensor([0] + torch.tensor(flat).cumsum(0).tolist(), dtype=torch.int32, device="cuda")

    def attn(q, k, v):
        b, s, h, d = q.shape
        out = flashgen.flash_attn_varlen_func(*(x.reshape(b * s, h, d) for x in (q, k, v)), cu, cu, max(flat),
                                              max(flat), causal=True)
        return out.view(b, s, h, d)
    return attn


def sdpa_docs_attention(lens: list, seqlen: int):
    """The same with SDPA: a boolean mask per row, causal within each document (BHSD views, back to BSHD)."""
    doc = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lens], device="cuda")
    pos = torch.arange(seqlen, device="cuda")
    allowed = (doc[:, :, None] == doc[:, None, :]) & (pos[None, :, None] >= pos[None, None, :])

    def attn(q, k, v):
        out = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask=allowed[:, None])
        return out.transpose(1, 2)
    return attn


@pytest.mark.parametrize("d_model,head_dim,seqlen", CONFIGS, ids=[f"hd{c[1]}_d{c[0]}_s{c[2]}" for c in CONFIGS])
def test_packed_documents_training_tracks_sdpa(d_model, head_dim, seqlen, monkeypatch):
    """The same model trained on packed documents (causal attention within each, FA3's varlen training) with
    flash_attn_varlen_func on the varlen kernels both ways (core.VARLEN_KERNEL and core.VARLEN_BWD_KERNEL switched
    on; every step's backward one varlen launch per layer), against SDPA with a per-document causal mask: the
    module docstring's rules."""
    need_variants(head_dim)
    key = {"dtype": "bf16", "head_dim": head_dim, "causal": True, "varlen": True}
    for family, k in (("fwd", {**key, "head_dim_v": head_dim}), ("bwd", key)):
        why = variant_missing(family, k)
        if why:
            pytest.skip(why)
    launches = varlen_kernels_on(monkeypatch)
    lens = doc_lengths(seqlen, seed=head_dim)
    torch.manual_seed(1234)
    base = TinyLM(d_model, head_dim, seqlen).cuda()
    tokens = make_batch(seqlen)
    loss_fg, g_fg = train(copy.deepcopy(base), flashgen_docs_attention(lens), tokens, STEPS)
    assert len(launches) == STEPS * LAYERS and all(x is not None for x in launches), \
        "the varlen backward did not serve every layer's backward"
    sdpa_docs = sdpa_docs_attention(lens, seqlen)
    loss_sd, g_sd = train(copy.deepcopy(base), sdpa_docs, tokens, STEPS)
    assert_tracks(f"hd{head_dim} packed docs", loss_fg, g_fg, loss_sd, g_sd, reference_grads(base, sdpa_docs, tokens))
