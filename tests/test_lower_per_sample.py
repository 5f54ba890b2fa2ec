"""options={"per_sample_clip": C}: per-example gradient norms against torch.func.vmap(grad) per example, and the
clipped sum p.grad = Σ_n min(1, C/‖g_n‖) g_n against an explicit loop over the examples (issue 14)."""
from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import adjoint_compile as ac

RTOL = 1e-5
#: the vmap oracle over scaled_dot_product_attention on CPU has no batching rule (slow path, correct)
pytestmark = pytest.mark.filterwarnings("ignore:There is a performance drop:UserWarning")


def _loss(out: torch.Tensor) -> torch.Tensor:
    return (out * out).sum()


def vmap_norms(model: nn.Module, inputs: tuple, bd: int = 0) -> torch.Tensor:
    """‖g_n‖ over all parameters, from torch.func.vmap(grad) over the examples."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def one(p, *xs):
        return _loss(torch.func.functional_call(model, p, tuple(x.unsqueeze(bd) for x in xs)))
    per = torch.func.vmap(torch.func.grad(one), in_dims=(None, *([bd] * len(inputs))))(params, *inputs)
    return torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per.values()))


def loop_clipped(model: nn.Module, inputs: tuple, clip: float, bd: int = 0,
                 scale: dict | None = None) -> tuple[dict, torch.Tensor]:
    """Σ_n min(1, C/‖g_n‖) g_n by an explicit loop: one eager backward per example (on a copy of the model: the
    compiled one's parameters refuse an unclipped backward)."""
    model = copy.deepcopy(model)
    B = inputs[0].shape[bd]
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    norms = []
    for i in range(B):
        model.zero_grad()
        _loss(model(*(x.narrow(bd, i, 1) for x in inputs))).backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in g.values()))
        c = 1.0 if math.isinf(clip) or norm <= clip else clip / norm
        for n, v in g.items():
            total[n] += c * v
        if scale is not None:  # Σ_n c_n ‖g_n‖: what the sum's rounding is relative to
            scale["all"] = scale.get("all", 0.0) + c * norm
        norms.append(norm)
    model.zero_grad()
    return total, torch.tensor(norms)


def check(model: nn.Module, *inputs: torch.Tensor, clip: float = 0.7, bd: int = 0, inner: str = "aot_eager",
          **options: Any):
    """Compile with per_sample_clip (and ``options``), run one step, compare norms and grads with the oracles;
    returns the report."""
    want_norms = vmap_norms(model, inputs, bd)
    scale: dict = {}
    want_grads, loop_norms = loop_clipped(model, inputs, clip, bd, scale)
    torch.testing.assert_close(loop_norms.float(), want_norms, rtol=RTOL, atol=0)
    compiled = torch.compile(model, backend="adjoint",
                             options={"per_sample_clip": clip, "batch_dim": bd, "inner": inner, **options})
    model.zero_grad()
    _loss(compiled(*inputs)).backward()
    got = ac.per_sample_grad_norms(compiled)
    assert got.shape == (inputs[0].shape[bd],)
    torch.testing.assert_close(got, want_norms, rtol=RTOL, atol=0)
    assert (got > clip).any() or math.isinf(clip) or clip > want_norms.max(), "the test should clip something"
    for n, p in model.named_parameters():
        if p.requires_grad:
            # NB: atol relative to the clipped gradients' size: an entry that is a sum (over steps, over examples)
            # cancelling to ~0 keeps the rounding of its terms
            atol = 1e-6 + RTOL * scale["all"]
            torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-4, atol=atol, msg=lambda m: f"{n}: {m}")
    return ac.report(compiled)


def _uses(rep) -> list[dict]:
    return [u for c in rep.compiled if c.per_sample is not None for u in c.per_sample.uses]


@pytest.mark.parametrize("B", [1, 5])
def test_linear_on_vectors(B):
    torch.manual_seed(0)
    check(nn.Sequential(nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3)), torch.randn(B, 7))


@pytest.mark.parametrize("T,d,form", [(3, 8, "gram"), (9, 3, "direct"), (1, 5, "gram")])
def test_linear_on_sequences_gram_and_direct(T, d, form):
    torch.manual_seed(1)
    rep = check(nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, 2, bias=False)), torch.randn(3, T, d))
    assert _uses(rep)[0]["form"] == form


def test_embedding_with_repeated_tokens_and_padding():
    torch.manual_seed(2)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.e = nn.Embedding(6, 4, padding_idx=0)
            self.o = nn.Linear(4, 2)

        def forward(self, i):
            return self.o(self.e(i))
    idx = torch.tensor([[1, 1, 2, 0, 1], [3, 0, 0, 5, 3], [4, 4, 4, 4, 4]])
    rep = check(M(), idx)
    assert [u["kind"] for u in _uses(rep)] == ["embedding", "linear"]


def test_layer_norm_and_rms_norm_affine():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.ReLU(), nn.RMSNorm(6), nn.Linear(6, 2))
    with torch.no_grad():
        for m in model:
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm)):
                m.weight.normal_()
    rep = check(model, torch.randn(3, 4, 5))
    assert sum(u["kind"] == "elementwise" for u in _uses(rep)) == 3


class Attention(nn.Module):
    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.h = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (f(x).view(B, T, self.h, D // self.h).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(a.transpose(1, 2).reshape(B, T, D))


def test_attention_projections():
    torch.manual_seed(4)
    rep = check(Attention(), torch.randn(3, 5, 8))
    assert sum(u["kind"] == "linear" for u in _uses(rep)) == 4


class MHA(nn.Module):
    """nn.MultiheadAttention as users write it: self-attention, or cross-attention on a projected memory (``cross``:
    the packed in_proj_weight by row slices, or separate q/k/v weights when ``kdim`` differs)."""

    def __init__(self, batch_first: bool = True, bias: bool = True, kdim: int | None = None, cross: bool = False,
                 mask: str = "", need_weights: bool = False) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(8, 2, batch_first=batch_first, bias=bias, kdim=kdim, vdim=kdim)
        self.mem = nn.Linear(8, kdim or 8) if cross or kdim else None
        self.bf, self.mask, self.need_weights = batch_first, mask, need_weights

    def forward(self, x):
        m = self.mem(torch.tanh(x)) if self.mem is not None else x
        T = x.shape[1 if self.bf else 0]
        kw: dict = {}
        if self.mask == "causal":
            kw = {"attn_mask": nn.Transformer.generate_square_subsequent_mask(T), "is_causal": True}
        elif self.mask == "bool":
            kw = {"attn_mask": torch.ones(T, T, dtype=torch.bool).triu(1)}
        elif self.mask == "padding":
            B = x.shape[0 if self.bf else 1]
            kw = {"key_padding_mask": torch.arange(T).expand(B, T) >= T - 1}
        out, w = self.mha(x, m, m, need_weights=self.need_weights, **kw)
        return out if w is None else out + w.sum(-1, keepdim=True)


@pytest.mark.parametrize("kw", [{}, {"bias": False}, {"batch_first": False}, {"kdim": 5}, {"cross": True},
                                {"mask": "causal"}, {"mask": "bool", "batch_first": False}, {"mask": "padding"},
                                {"need_weights": True, "kdim": 6}, {"need_weights": True, "mask": "causal"}],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
def test_multihead_attention(kw):
    """nn.MultiheadAttention (dynamo keeps it one multi_head_attention_forward call): its projections' per-example
    gradients, exact against vmap(grad), for both layouts, with and without bias, kdim/vdim, masks and weights."""
    torch.manual_seed(21)
    model = MHA(**kw)
    T, B = 5, 3
    bf = kw.get("batch_first", True)
    x = torch.randn(B, T, 8) if bf else torch.randn(T, B, 8)
    rep = check(model, x, bd=0 if bf else 1)
    att = [u for u in _uses(rep) if u["kind"] == "attention"]
    assert len(att) == 1 and any("in_proj" in p or "q_proj" in p for p in att[0]["params"]), att


def test_multihead_attention_refuses_bias_kv():
    model = nn.MultiheadAttention(8, 2, batch_first=True, add_bias_kv=True)
    f = torch.compile(lambda x: model(x, x, x, need_weights=False)[0], backend="adjoint",
                      options={"per_sample_clip": 1.0, "inner": "aot_eager"})
    with pytest.raises(Exception, match="bias_k"):
        f(torch.randn(3, 4, 8))


class _Logits(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        return self.lm(input_ids=ids).logits


_ARCH = {"gpt2": "GPT2", "llama": "Llama"}


def _tiny_config(arch: str, layers: int = 2, **extra: Any):
    """A tiny random transformers config: GPT-2 (Conv1D projections) or Llama (grouped-query attention)."""
    import transformers
    common = {"vocab_size": 17, "bos_token_id": 0, "eos_token_id": 1, **extra}
    if arch == "gpt2":
        return transformers.GPT2Config(n_positions=16, n_embd=8, n_layer=layers, n_head=2, attn_pdrop=0.0,
                                       resid_pdrop=0.0, embd_pdrop=0.0, **common)
    return transformers.LlamaConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=layers,
                                    num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16, **common)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_transformers_tiny_sequence_classification(arch):
    """transformers' ...ForSequenceClassification: the logits of each sequence's last token picked with
    ``logits[arange(B), last_non_pad_token]`` (one row per example; it was refused as mixing the examples)."""
    import transformers
    torch.manual_seed(23)
    lm = getattr(transformers, f"{_ARCH[arch]}ForSequenceClassification")(_tiny_config(arch, 1, pad_token_id=1,
                                                                                       num_labels=3))
    lm.config._attn_implementation = "sdpa"
    ids = torch.randint(2, 17, (3, 5))
    ids[0, 3:] = 1  # NB: a padded sequence: its last token is at 2
    model = _Logits(lm).double()
    _, norms = loop_clipped(model, (ids,), math.inf)  # NB: the oracle is the loop: the pooling reads .item() (no vmap)
    clip = float(norms.min() + norms.max()) / 2
    want, _ = loop_clipped(model, (ids,), clip)
    compiled = torch.compile(model, backend="adjoint", options={"per_sample_clip": clip, "inner": "aot_eager"})
    _loss(compiled(ids)).backward()
    # NB: 1e-6: transformers computes parts in fp32 whatever the model's dtype (the eager loop does too)
    torch.testing.assert_close(ac.per_sample_grad_norms(compiled), norms.double(), rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-9, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_transformers_tiny_gpt2_and_llama(arch):
    """transformers' GPT-2 (Conv1D projections: addmm on flattened tokens; tied head) and Llama (grouped-query
    attention through scaled_dot_product_attention, RMSNorm, rotary embeddings), tiny random configs."""
    import transformers  # the dev extra: tests run the real implementations
    torch.manual_seed(22)
    lm = getattr(transformers, {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[arch])(_tiny_config(arch))
    lm.config._attn_implementation = "sdpa"
    rep = check(_Logits(lm), torch.randint(0, 17, (3, 5)), clip=1.0)
    kinds = {u["kind"] for u in _uses(rep)}
    assert {"embedding", "elementwise"} <= kinds and kinds & {"linear", "matmul"}, kinds


class _MaskedLogits(nn.Module):
    def __init__(self, lm: nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, ids, mask):
        return self.lm(input_ids=ids, attention_mask=mask).logits


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_transformers_tiny_lm_with_an_attention_mask(arch):
    """transformers' causal LMs given an ``attention_mask``: the 4-D mask is built as ``mask[arange(B)[:, None,
    None, None], kv_idx[None, None, None]]`` and expanded; each example's rows are its own (it was refused as
    reading other examples' values). Padded sequences, left and right, against an eager loop over the examples."""
    import transformers
    torch.manual_seed(24)
    lm = getattr(transformers, {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[arch])(_tiny_config(arch))
    lm.config._attn_implementation = "sdpa"
    ids = torch.randint(2, 17, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, 5:] = 0
    mask[2, :2] = 0
    model = _MaskedLogits(lm).double()
    _, norms = loop_clipped(model, (ids, mask), math.inf)
    clip = float(norms.min() + norms.max()) / 2
    want, _ = loop_clipped(model, (ids, mask), clip)
    compiled = torch.compile(model, backend="adjoint", options={"per_sample_clip": clip, "inner": "aot_eager"})
    _loss(compiled(ids, mask)).backward()
    torch.testing.assert_close(ac.per_sample_grad_norms(compiled), norms.double(), rtol=1e-6, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-9, msg=lambda m: f"{n}: {m}")


def test_low_rank_factor_pair():
    torch.manual_seed(5)

    class LowRank(nn.Module):
        def __init__(self):
            super().__init__()
            self.U = nn.Parameter(torch.randn(6, 2))
            self.V = nn.Parameter(torch.randn(2, 6))

        def forward(self, x):
            return torch.tanh(x @ self.U @ self.V)
    rep = check(LowRank(), torch.randn(5, 3, 6))
    assert [u["kind"] for u in _uses(rep)] == ["matmul", "matmul"]


class TinyTransformer(nn.Module):
    """embedding, pre-LN attention and MLP, tied output projection when ``tied``."""

    def __init__(self, vocab: int = 11, d: int = 8, tied: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.ln1, self.ln2, self.lnf = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.att = Attention(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, i):
        x = self.emb(i)
        x = x + self.att(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return self.head(self.lnf(x))


@pytest.mark.parametrize("B,T", [(1, 4), (3, 5)])
def test_layer_kinds_in_combination(B, T):
    torch.manual_seed(6)
    check(TinyTransformer(), torch.randint(0, 11, (B, T)), clip=1.0)


def test_tied_weights_are_summed_before_the_norm():
    torch.manual_seed(7)
    model = TinyTransformer(tied=True)
    rep = check(model, torch.randint(0, 11, (3, 4)), clip=1.0)
    tied = [u for u in _uses(rep) if u["tied"]]
    assert {u["kind"] for u in tied} == {"embedding", "linear"}


def test_a_graph_break_norms_span_both_graphs():
    torch.manual_seed(15)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 2)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            torch._dynamo.graph_break()
            return self.b(h)
    rep = check(M(), torch.randn(3, 4))
    assert len(rep.compiled) == 2 and all(c.per_sample is not None for c in rep.compiled)


def test_changing_batch_sizes_are_specialized_never_unclipped():
    """A new batch size makes dynamo recompile with a symbolic batch: the backend specializes it per size, so every
    step is clipped, with no limit on the number of sizes."""
    torch.manual_seed(16)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 0.5, "inner": "aot_eager"})
    for B in (3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 5):
        x = torch.randn(B, 4)
        want_grads, _ = loop_clipped(model, (x,), 0.5)
        model.zero_grad()
        _loss(f(x)).backward()
        torch.testing.assert_close(ac.per_sample_grad_norms(f), vmap_norms(model, (x,)), rtol=RTOL, atol=0)
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-4, atol=1e-6)
    assert any(len(c.specializations) >= 9 for c in ac.report(f).compiled), "the symbolic graph was not exercised"


def _three_layers() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))


def test_past_dynamos_recompile_limit_an_unclipped_backward_raises():
    """dynamic=False: every batch size is a recompile; the 9th runs eagerly (dynamo's recompile_limit, 8), and its
    backward would give unclipped gradients: it raises, naming a parameter, instead."""
    torch.manual_seed(18)
    model = _three_layers()
    f = torch.compile(model, backend="adjoint", dynamic=False, options={"per_sample_clip": 0.5, "inner": "aot_eager"})
    limit = torch._dynamo.config.recompile_limit
    for B in range(2, 2 + limit):  # clipped, like the reference
        x = torch.randn(B, 4)
        want_grads, _ = loop_clipped(model, (x,), 0.5)
        model.zero_grad()
        _loss(f(x)).backward()
        torch.testing.assert_close(model[2].weight.grad, want_grads["2.weight"], rtol=1e-4, atol=1e-6)
    model.zero_grad()
    out = f(torch.randn(2 + limit, 4))
    with pytest.raises(ac.PerSampleError, match=r"parameter \d\.(weight|bias) .* unclipped gradient"):
        _loss(out).backward()


@torch._dynamo.disable
def _eager_matmul(h, w):
    return h @ w.t()


class _UseOutside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.c(_eager_matmul(h, self.b.weight))  # a graph break: b.weight is used eagerly


def test_a_parameter_used_outside_the_backend_raises_naming_it():
    torch.manual_seed(19)
    f = torch.compile(_UseOutside(), backend="adjoint", options={"per_sample_clip": 0.5, "inner": "aot_eager"})
    with pytest.raises(ac.PerSampleError, match=r"parameter b\.weight \(5, 5\)"):
        _loss(f(torch.randn(3, 4))).backward()


class _BreakInLoop(nn.Module):
    """A sanity check inside the loop over layers (a graph break there): dynamo runs the whole forward eagerly and
    compiles only frames it calls (``linear_scan``'s own, with no parameter in it), or none (``scan=False``)."""

    def __init__(self, scan: bool = True) -> None:
        super().__init__()
        self.scan = scan
        self.inp, self.gate = (nn.ModuleList([nn.Linear(4, 4) for _ in range(2)]) for _ in range(2))

    def forward(self, x):
        for inp, gate in zip(self.inp, self.gate):
            u = inp(x)
            a = torch.sigmoid(gate(u))
            x = x + ac.ops.linear_scan(a, (1 - a) * u, dim=1) if self.scan else torch.tanh(a * u)
            if x.abs().max() > 1e6:
                x = x / 2
        return x


def test_a_forward_dynamo_runs_eagerly_around_a_compiled_frame_raises():
    """The parameters of the modules running eagerly around a compiled frame are guarded too: the backward of their
    eager uses would be unclipped."""
    torch.manual_seed(21)
    f = torch.compile(_BreakInLoop(), backend="adjoint", options={"per_sample_clip": 0.5, "shard_size": 4,
                                                                    "inner": "aot_eager"})
    with pytest.raises(ac.PerSampleError, match=r"parameter _BreakInLoop\.(inp|gate)\.\d\.(weight|bias) .* unclipped"):
        _loss(f(torch.randn(3, 13, 4))).backward()


def test_a_forward_dynamo_never_compiles_is_named_by_the_norms():
    """No frame compiled at all (the backend never runs): the norms say the gradients were not clipped."""
    torch.manual_seed(22)
    f = torch.compile(_BreakInLoop(scan=False), backend="adjoint", options={"per_sample_clip": 0.5,
                                                                              "inner": "aot_eager"})
    _loss(f(torch.randn(3, 13, 4))).backward()
    with pytest.raises(ValueError, match="NOT clipped"):
        ac.per_sample_grad_norms(f)


def test_the_guard_stays_quiet_in_ordinary_use():
    """Several steps with zero_grad (to None and in place) between them, gradient accumulation, eval without a
    backward and under no_grad, an optimizer step: no spurious PerSampleError."""
    torch.manual_seed(20)
    model = _three_layers()
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 0.5, "inner": "aot_eager"})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    for set_to_none in (True, False, True):
        opt.zero_grad(set_to_none=set_to_none)
        _loss(f(x)).backward()
        _loss(f(x)).backward()  # accumulation over two micro-batches
        opt.step()
    want_grads, _ = loop_clipped(model, (x,), 0.5)
    opt.zero_grad(set_to_none=False)
    _loss(f(x)).backward()
    torch.testing.assert_close(model[0].weight.grad, want_grads["0.weight"], rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        f(x)
    f.eval()
    f(x)
    model(x)  # the uncompiled model's forward alone accumulates nothing


def test_a_backward_that_raised_leaves_nothing_for_the_next():
    torch.manual_seed(17)

    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            raise RuntimeError("boom")

    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 3)
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 0.5, "inner": "aot_eager"})
    with pytest.raises(RuntimeError, match="boom"):  # both layers' records are taken, then the backward fails
        _loss(f(Boom.apply(x.clone().requires_grad_()))).backward()
    want_grads, _ = loop_clipped(model, (x.detach(),), 0.5)
    model.zero_grad()
    _loss(f(x.detach())).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-4, atol=1e-6)


def test_clip_inf_gives_norms_and_the_plain_sum():
    torch.manual_seed(8)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    x = torch.randn(5, 3, 4)
    check(model, x, clip=float("inf"))
    plain = {n: p.grad.clone() for n, p in model.named_parameters()}
    eager = copy.deepcopy(model)
    eager.zero_grad()
    _loss(eager(x)).backward()  # the ordinary summed gradient
    for n, p in eager.named_parameters():
        torch.testing.assert_close(plain[n], p.grad, rtol=1e-5, atol=1e-6)


def test_buffers_and_frozen_parameters_are_not_examples_nor_clipped():
    torch.manual_seed(13)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.rand(7, 3) + 0.5)  # used first, with a leading size that is not B
            self.frozen = nn.Linear(3, 3)
            self.frozen.requires_grad_(False)
            self.l = nn.Linear(3, 2)

        def forward(self, x):
            return self.l(self.frozen(x * self.scale[0]))
    model = M()
    check(model, torch.randn(4, 3))
    assert model.frozen.weight.grad is None


def test_elementwise_uses_with_either_operand_order():
    torch.manual_seed(14)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.c, self.s, self.b = (nn.Parameter(torch.randn(3)) for _ in range(3))

        def forward(self, x):
            return torch.tanh((self.c - x) * self.s) - self.b
    rep = check(M(), torch.randn(5, 2, 3))
    assert [u["kind"] for u in _uses(rep)] == ["elementwise"] * 3


def test_generic_fallback_reports_its_memory():
    torch.manual_seed(9)

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.log_scale = nn.Parameter(torch.randn(4))
            self.l = nn.Linear(4, 4)

        def forward(self, x):
            return self.l(x) / torch.exp(self.log_scale)  # a parameter-only expression, then a division
    rep = check(M(), torch.randn(3, 2, 4))
    generic = [u for u in _uses(rep) if u["kind"] == "generic"]
    assert len(generic) == 1 and generic[0]["extra_bytes"] == 3 * 4 * 4
    assert "per-example gradients (vmap)" in rep.text()


def test_batch_dim_1_sequence_first():
    torch.manual_seed(10)
    check(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)), torch.randn(6, 3, 4), bd=1)


def test_loss_inside_the_graph_is_a_sum_over_examples():
    torch.manual_seed(11)
    model = nn.Sequential(nn.Linear(4, 3))
    x, y = torch.randn(5, 4), torch.randint(0, 3, (5,))

    def step(x, y):
        return F.cross_entropy(model(x), y, reduction="sum") * 0.5
    f = torch.compile(step, backend="adjoint", options={"per_sample_clip": 0.3, "inner": "aot_eager"})
    f(x, y).backward()
    got = ac.per_sample_grad_norms(f)
    params = {n: p.detach() for n, p in model.named_parameters()}
    per = torch.func.vmap(torch.func.grad(
        lambda p, xi, yi: F.cross_entropy(torch.func.functional_call(model, p, (xi[None],)), yi[None],
                                          reduction="sum") * 0.5), in_dims=(None, 0, 0))(params, x, y)
    want = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per.values()))
    torch.testing.assert_close(got, want, rtol=RTOL, atol=0)
    c = torch.clamp(0.3 / want, max=1)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, per[n]), rtol=1e-4, atol=1e-6)


def test_refuses_batch_norm_in_training_mode():
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 1.0, "inner": "aot_eager"})
    with pytest.raises(ac.PerSampleError, match=r"batch_norm .*mixes the examples.*test_lower_per_sample.py|batch_norm"):
        f(torch.randn(4, 4))
    model.eval()  # running statistics: no mixing
    torch._dynamo.reset()
    check(model, torch.randn(4, 4))


def test_refuses_a_sum_over_the_batch_before_the_loss():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(4, 3)

        def forward(self, x):
            h = self.l(x)
            return h - h.mean(0)  # centring over the batch: every example's output depends on all of them
    f = torch.compile(M(), backend="adjoint", options={"per_sample_clip": 1.0, "inner": "aot_eager"})
    with pytest.raises(ValueError, match=r"sub .*reduced over the batch axis.*mean .*test_lower_per_sample.py"):
        f(torch.randn(4, 4))


def test_refuses_a_nonlinear_loss_of_a_batch_sum():
    model = nn.Linear(4, 3)
    f = torch.compile(lambda x: model(x).sum(0).pow(2).sum(), backend="adjoint",
                      options={"per_sample_clip": 1.0, "inner": "aot_eager"})
    with pytest.raises(ac.PerSampleError, match="pow"):
        f(torch.randn(4, 4))


def test_refuses_a_max_over_the_batch():
    model = nn.Linear(4, 3)
    f = torch.compile(lambda x: model(x).amax(), backend="adjoint",
                      options={"per_sample_clip": 1.0, "inner": "aot_eager"})
    with pytest.raises(ac.PerSampleError, match="amax .*not a sum or mean"):
        f(torch.randn(4, 4))


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "1", [1.0], float("-inf")])
def test_bad_per_sample_clip(bad):
    with pytest.raises(ac.OptionsError, match=r"'per_sample_clip'=.*expected a number C > 0"):
        ac.validate_options({"per_sample_clip": bad})


@pytest.mark.parametrize("bad", [-1, True, 0.5, "0"])
def test_bad_batch_dim(bad):
    with pytest.raises(ac.OptionsError, match=r"'batch_dim'=.*expected an int >= 0"):
        ac.validate_options({"per_sample_clip": 1.0, "batch_dim": bad})


def test_batch_dim_alone_refused():
    # the example axis is read by per_sample_clip only: alone it would be accepted and do nothing
    with pytest.raises(ac.OptionsError, match=r"'batch_dim'=1 .*applies to per_sample_clip only"):
        ac.validate_options({"batch_dim": 1})


def test_good_options():
    o = ac.validate_options({"per_sample_clip": 2, "batch_dim": 1})
    assert (o.per_sample_clip, o.batch_dim) == (2.0, 1)
    assert ac.validate_options({"per_sample_clip": float("inf")}).per_sample_clip == math.inf


def test_norms_before_any_backward_and_without_the_option():
    model = nn.Linear(3, 2)
    f = torch.compile(model, backend="adjoint", options={"inner": "aot_eager"})
    f(torch.randn(2, 3))
    with pytest.raises(ValueError, match="per_sample_clip"):
        ac.per_sample_grad_norms(f)
    torch._dynamo.reset()
    g = torch.compile(model, backend="adjoint", options={"per_sample_clip": 1.0, "inner": "aot_eager"})
    g(torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="no backward"):
        ac.per_sample_grad_norms(g)


def _ssm_module():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "example_selective_ssm", Path(__file__).resolve().parent.parent / "examples" / "selective_ssm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("B,T,layers", [(1, 7, 1), (3, 7, 2), (3, 1, 1), (5, 7, 1)])
def test_selective_ssm_parameters_inside_a_sharded_region(B, T, layers, monkeypatch):
    """The demo SSM under per_sample_clip with shard_size=3: its scan region is sharded (rewrite "adjoint"); every
    parameter the region uses (A_log through A = -exp(A_log), the projections, D_skip, the norms) gets exact
    per-example norms (against vmap(grad)) and the clipped sum (against a per-example loop)."""
    from adjoint_compile.runtime import sharded_ps

    calls = []
    real = sharded_ps._expanded_grads
    monkeypatch.setattr(sharded_ps, "_expanded_grads", lambda *a: calls.append(1) or real(*a))
    torch.manual_seed(12)
    model = _ssm_module().make(d_model=4, d_state=2, n_layers=layers)
    x = torch.randn(B, T, 4)
    want_norms = vmap_norms(model, (x,))
    clip = float(want_norms.min()) * 0.9 if B == 1 else float(want_norms.median())
    rep = check(model, x, clip=clip, shard_size=3)
    recs = [r for r in rep.regions if r.kind == "linear_recurrence"]
    if T <= 3:  # one shard saves nothing, and the per-example gradients it would keep make it cost: declined
        assert recs and all(r.rewrite == "none" and "per-example parameter gradients" in r.reason for r in recs), [
            (r.rewrite, r.reason) for r in recs]
        return
    assert recs and all(r.rewrite == "adjoint" for r in recs), [(r.rewrite, r.reason) for r in recs]
    assert calls, "the per-example expanded parameters (one backward per shard) were not used"
    sharded = [u for u in _uses(rep) if u["kind"] == "sharded region"]
    assert sharded and any("a_log" in p.lower() for u in sharded for p in u["params"])
    text = str(ac.explain(model, x, options={"per_sample_clip": clip, "shard_size": 3}))
    assert "sharded exact adjoint" in text and "sharded region of" in text, text


def test_sharded_region_parameters_not_expandable_fall_back_to_masked_vjps(monkeypatch):
    """A region whose parameter reaches the examples through an op the per-example expansion does not take (here:
    exp, taken out of its list) falls back to one masked VJP per example: the same exact result."""
    from adjoint_compile.runtime import per_example_program, sharded_ps

    refused = []
    real = sharded_ps._expanded_grads

    def spy(*a):
        try:
            return real(*a)
        except per_example_program.NotExpandable as e:
            refused.append(str(e))
            raise
    monkeypatch.setattr(sharded_ps, "_expanded_grads", spy)
    monkeypatch.setattr(per_example_program, "_CHAIN", per_example_program._CHAIN - {"exp"})
    torch.manual_seed(3)
    model = _ssm_module().make(d_model=4, d_state=2, n_layers=1)
    x = torch.randn(3, 5, 4)
    rep = check(model, x, clip=float(vmap_norms(model, (x,)).median()), shard_size=2)
    assert any(r.rewrite == "adjoint" for r in rep.regions)
    assert refused and "exp" in refused[0], refused


@pytest.mark.parametrize("per_vjp,batched", [(2, True), (2, False), (5, True)])
def test_sharded_region_batched_vjps_and_their_fallback(monkeypatch, per_vjp, batched):
    """Examples batched per VJP (is_grads_batched, in chunks: 2+2+1 and 5), and the fallback when a batched VJP
    cannot run (one masked VJP per example): the same result."""
    from adjoint_compile.runtime import sharded_ps

    monkeypatch.setattr(sharded_ps, "_EXPANDED", [False])
    monkeypatch.setattr(sharded_ps, "_BATCHED", [batched])
    monkeypatch.setattr(sharded_ps, "EXAMPLES_PER_VJP", per_vjp)
    torch.manual_seed(3)
    model = _ssm_module().make(d_model=4, d_state=2, n_layers=1)
    x = torch.randn(5, 5, 4)
    rep = check(model, x, clip=float(vmap_norms(model, (x,)).median()), shard_size=2)
    assert any(r.rewrite == "adjoint" for r in rep.regions)


def test_selective_ssm_truncated_mode_stays_unsharded_under_per_sample_clip():
    """Only the exact adjoint keeps per-example gradients: in truncated mode the region keeps ordinary autograd
    (explain says why) and the norms are still exact."""
    torch.manual_seed(12)
    model = _ssm_module().make(d_model=4, d_state=2, n_layers=1)
    x = torch.randn(3, 5, 4)
    _, loop_norms = loop_clipped(model, (x,), float("inf"))
    want_grads, _ = loop_clipped(model, (x,), 0.5)
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": 0.5, "inner": "aot_eager",
                                                          "mode": "truncated", "window": 2})
    _loss(f(x)).backward()
    torch.testing.assert_close(ac.per_sample_grad_norms(f), loop_norms.float(), rtol=RTOL, atol=0)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want_grads[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")
    rep = ac.report(f)
    assert rep.regions and all(r.rewrite == "none" and "per_sample_clip" in r.reason for r in rep.regions
                               if r.kind == "linear_recurrence")
    assert any(u["kind"] == "generic" for u in _uses(rep))


class _TiedScan(nn.Module):
    """``proj`` is used before a cumsum over time (outside the region: the cumsum mixes steps) and again inside the
    scan region: a tied use across the region's boundary."""

    def __init__(self, d: int = 3) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.gate = nn.Parameter(torch.linspace(-1.0, 1.0, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u = self.proj(x).cumsum(1)
        a = torch.sigmoid(self.proj(u) + self.gate)
        return ac.ops.linear_scan(a, u * self.gate)


@pytest.mark.parametrize("B", [1, 3])
def test_a_parameter_used_inside_and_outside_a_sharded_region_is_summed_before_the_norm(B):
    torch.manual_seed(5)
    model = _TiedScan()
    x = torch.randn(B, 5, 3)
    rep = check(model, x, clip=float(vmap_norms(model, (x,)).min()) * 0.9, shard_size=2)
    assert any(r.rewrite == "adjoint" for r in rep.regions), [(r.rewrite, r.reason) for r in rep.regions]
    region = [u for u in _uses(rep) if u["kind"] == "sharded region"]
    assert region and region[0]["tied"], _uses(rep)


class TwoLosses(nn.Module):
    """Two loss terms (two heads, a multi-token-prediction style), stacked and combined as training scripts do."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how, self.body, self.h1, self.h2 = how, nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        losses = [F.cross_entropy(self.h1(h), y, reduction="sum"), F.cross_entropy(self.h2(h), 2 - y, reduction="sum")]
        if self.how == "stack().sum()":
            return torch.stack(losses).sum()
        if self.how == "stack().mean(0)":
            return torch.stack(losses).mean(0)
        if self.how == "weighted":
            return (torch.stack(losses) * torch.tensor([0.7, 0.3], dtype=x.dtype)).sum()
        if self.how == "stack() @ w":
            return torch.stack(losses) @ torch.tensor([0.7, 0.3], dtype=x.dtype)
        return torch.cat([losses[0][None], losses[1].unsqueeze(0)])[1:].sum() + losses[0].view(1).squeeze()


@pytest.mark.parametrize("how", ["stack().sum()", "stack().mean(0)", "weighted", "stack() @ w", "cat, index, view"])
def test_losses_stacked_then_combined(how):
    """Scalar losses stacked (or concatenated, indexed, viewed) and summed or weighted: still a sum of per-example
    losses, so per-example gradients are those of vmap over the examples. They were refused as "reduced over the
    batch axis"."""
    torch.manual_seed(12)
    model = TwoLosses(how).double()
    x, y = torch.randn(5, 4, dtype=torch.float64), torch.randint(0, 3, (5,))
    params = {n: p.detach() for n, p in model.named_parameters()}
    per = torch.func.vmap(torch.func.grad(lambda p, xi, yi: torch.func.functional_call(model, p, (xi[None], yi[None]))),
                          in_dims=(None, 0, 0))(params, x, y)
    want = torch.sqrt(sum(g.flatten(1).pow(2).sum(1) for g in per.values()))
    clip = float(want.min() + want.max()) / 2
    f = torch.compile(model, backend="adjoint", options={"per_sample_clip": clip, "inner": "aot_eager"})
    f(x, y).backward()
    torch.testing.assert_close(ac.per_sample_grad_norms(f), want, rtol=1e-10, atol=0)
    c = torch.clamp(clip / want, max=1)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, torch.einsum("b,b...->...", c, per[n]), rtol=1e-10, atol=1e-12)


def test_refuses_stacked_losses_meeting_a_nonlinear_op():
    """A stack keeps the losses a sum over the examples only through linear ops: a product of the stacked losses is
    refused, naming it."""
    model = TwoLosses("stack().sum()")
    f = torch.compile(lambda x, y: torch.stack([model(x, y), model(x, y)]).prod(), backend="adjoint",
                      options={"per_sample_clip": 1.0, "inner": "aot_eager"})
    with pytest.raises(ac.PerSampleError, match="prod"):
        f(torch.randn(4, 4), torch.randint(0, 3, (4,)))
