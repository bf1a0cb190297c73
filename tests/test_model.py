"""The single-device reference model: shapes, deterministic init, stage splitting, KV-cache
decoding, causality, Hugging Face parity and the sampler."""

import math

import pytest
import torch

from ndtrain.generate import sample
from ndtrain.model import PRESETS, KVCache, ModelArgs, Transformer, flops_per_token, param_count
from ndtrain.model.hf import args_from_hf_config, from_hf_state_dict, hf_config, to_hf_state_dict
from ndtrain.model.llama import Attention, rope_tables

TINY = PRESETS["tiny"]
TINY_TIED = TINY.with_(tie_embeddings=True)
BOTH = pytest.mark.parametrize("args", [TINY, TINY_TIED], ids=["untied", "tied"])


def build(args: ModelArgs, seed: int = 0, **kw) -> Transformer:
    model = Transformer(args, **kw)
    model.init_weights(seed)
    return model


def tokens(args: ModelArgs, b: int = 2, s: int = 16, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, args.vocab_size, (b, s), generator=g)


# --- shapes and counts -----------------------------------------------------------------

@pytest.mark.parametrize("args", [TINY, TINY_TIED, PRESETS["small"]], ids=["tiny", "tied", "small"])
def test_num_params_matches_param_count(args):
    assert Transformer(args).num_params() == param_count(args)


def test_tied_output_is_the_embedding():
    model = Transformer(TINY_TIED)
    assert model.output.weight is model.tok_embeddings.weight
    assert Transformer(TINY).output.weight is not Transformer(TINY).tok_embeddings.weight


@pytest.mark.parametrize("preset, published", [("8B", 8.03e9), ("1B", 1.24e9)])
def test_param_count_of_published_shapes(preset, published):
    assert param_count(PRESETS[preset]) == pytest.approx(published, rel=0.005)


def test_flops_per_token():
    for args in (TINY, PRESETS["8B"]):
        s = 1024
        expected = 6 * param_count(args, embedding=False) + 6 * args.n_layers * s * args.dim
        assert flops_per_token(args, s) == expected


# --- deterministic initialisation -------------------------------------------------------

@BOTH
def test_same_seed_same_weights(args):
    a, b, c = build(args, 7).state_dict(), build(args, 7).state_dict(), build(args, 8).state_dict()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert not torch.equal(a["layers.0.attention.wq.weight"], c["layers.0.attention.wq.weight"])


def test_init_std_and_norms():
    args = PRESETS["small"]
    model = build(args)
    assert model.tok_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.05)
    wo = model.layers["0"].attention.wo.weight
    assert wo.std().item() == pytest.approx(0.02 / math.sqrt(2 * args.n_layers), rel=0.05)
    assert torch.equal(model.layers["1"].ffn_norm.weight, torch.ones(args.dim))


def test_init_independent_of_dtype():
    fp32 = build(TINY).state_dict()
    fp64 = Transformer(TINY).double()
    fp64.init_weights(0)
    for name, t in fp64.state_dict().items():
        assert torch.equal(t, fp32[name].double()), name


@BOTH
def test_stage_weights_equal_full_model(args):
    full = build(args).state_dict()
    stage = build(args, layer_ids=[2, 3], embed=False, head=True)
    assert list(stage.layers.keys()) == ["2", "3"]
    assert stage.tok_embeddings is None
    for name, t in stage.state_dict().items():
        # A head-only stage of a tied model starts its own output from the embedding.
        ref = full["tok_embeddings.weight"] if name == "output.weight" and args.tie_embeddings else full[name]
        assert torch.equal(t, ref), name
    if args.tie_embeddings:
        assert torch.equal(stage.output.weight, full["tok_embeddings.weight"])


@BOTH
def test_two_stages_equal_full_forward(args):
    full = build(args)
    first = build(args, layer_ids=[0, 1], head=False)
    second = build(args, layer_ids=[2, 3], embed=False)
    assert first.output is None and first.norm is None
    x = tokens(args)
    hidden = first(x)
    assert hidden.shape == (2, 16, args.dim)
    assert torch.equal(second(hidden), full(x))


# --- attention --------------------------------------------------------------------------

def test_causality():
    model = build(TINY)
    x = tokens(TINY, b=1, s=12)
    y = x.clone()
    y[0, 8:] = (y[0, 8:] + 1) % TINY.vocab_size
    out_x, out_y = model(x), model(y)
    assert torch.equal(out_x[:, :8], out_y[:, :8])
    assert not torch.allclose(out_x[:, 8:], out_y[:, 8:])


def test_attention_head_shards_sum_to_full():
    """Heads come from tensor shapes: an attention holding half the heads (as a tensor
    parallel shard would) runs unchanged, and the two halves' outputs sum to the whole."""
    torch.manual_seed(0)
    full = Attention(TINY)
    hd = TINY.head_dim
    x = torch.randn(2, 10, TINY.dim)
    cos, sin = (t[:10] for t in rope_tables(hd, TINY.max_seq_len, TINY.rope_theta))
    q_rows, kv_rows = TINY.n_heads * hd // 2, TINY.n_kv_heads * hd // 2
    total = 0
    for r in range(2):
        shard = Attention(TINY)
        shard.wq.weight = torch.nn.Parameter(full.wq.weight[r * q_rows:(r + 1) * q_rows])
        shard.wk.weight = torch.nn.Parameter(full.wk.weight[r * kv_rows:(r + 1) * kv_rows])
        shard.wv.weight = torch.nn.Parameter(full.wv.weight[r * kv_rows:(r + 1) * kv_rows])
        shard.wo.weight = torch.nn.Parameter(full.wo.weight[:, r * q_rows:(r + 1) * q_rows])
        total = total + shard(x, cos, sin)
    torch.testing.assert_close(total, full(x, cos, sin), atol=1e-6, rtol=1e-5)


def test_dropout_only_in_training():
    model = build(TINY.with_(dropout=0.5))
    x = tokens(TINY, b=1, s=8)
    model.eval()
    assert torch.equal(model(x), model(x))
    model.train()
    assert not torch.equal(model(x), model(x))


def test_rope_tables_stay_fp32_under_dtype_cast():
    model = build(TINY).to(torch.bfloat16)
    assert model.rotary.cos.dtype == torch.float32 and model.rotary.sin.dtype == torch.float32
    assert model(tokens(TINY, b=1, s=4)).dtype == torch.bfloat16


# --- KV cache and sampling --------------------------------------------------------------

@BOTH
def test_kv_cache_decode_matches_full_forward(args):
    model = build(args).eval()
    x = tokens(args, b=2, s=14)
    full = model(x)
    cache = KVCache(args.max_seq_len)
    pieces = [model(x[:, :6], cache=cache)]  # prefill
    pieces += [model(x[:, i:i + 1], cache=cache) for i in range(6, 10)]  # one token at a time
    pieces.append(model(x[:, 10:], cache=cache))  # a chunk after cached positions
    assert cache.pos == 14
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def test_kv_cache_overflow_is_an_error():
    model = build(TINY)
    cache = KVCache(8)
    model(tokens(TINY, b=1, s=8), cache=cache)
    with pytest.raises(ValueError, match="max_len"):
        model(tokens(TINY, b=1, s=1), cache=cache)


def greedy_without_cache(model, prompt, n):
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


@BOTH
def test_greedy_sample_equals_no_cache_loop(args):
    model = build(args).eval()
    prompt = tokens(args, b=1, s=5)[0].tolist()
    new = sample(model, prompt, 12, temperature=0)
    assert len(new) == 12
    assert new == greedy_without_cache(model, prompt, 12)


def test_sample_seeded_eot_and_truncation():
    args = TINY.with_(max_seq_len=32)
    model = build(args)
    prompt = tokens(args, b=1, s=6)[0].tolist()
    a = sample(model, prompt, 10, temperature=1.0, top_k=20, seed=3)
    assert a == sample(model, prompt, 10, temperature=1.0, top_k=20, seed=3)
    assert len(a) == 10 and all(0 <= t < args.vocab_size for t in a)
    # Stops after the end-of-text token, which is included.
    stopped = sample(model, prompt, 10, temperature=1.0, top_k=20, seed=3, eot_id=a[3])
    assert stopped == a[:a.index(a[3]) + 1]
    # A prompt longer than the context is cut from the left, with a warning that says so.
    long_prompt = tokens(args, b=1, s=50)[0].tolist()
    with pytest.warns(UserWarning, match="the prompt's first 25 of 50 tokens were dropped"):
        new = sample(model, long_prompt, 8, temperature=0)
    assert new == sample(model, long_prompt[-(32 - 8 + 1):], 8, temperature=0)
    assert model.training  # sample restores the mode


# --- Hugging Face -----------------------------------------------------------------------

def hf_model(args: ModelArgs, state: dict, attn: str = "sdpa"):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(**hf_config(args), attn_implementation=attn)
    model = transformers.LlamaForCausalLM(config).to(torch.float32).eval()
    hf_state = to_hf_state_dict(state, args)
    missing, unexpected = model.load_state_dict(hf_state, strict=False)
    assert not unexpected
    assert missing == (["lm_head.weight"] if args.tie_embeddings else [])
    return model


@BOTH
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_hf_parity(args, attn):
    ours = build(args).eval()
    with torch.no_grad():  # sharpen attention so that a wrong rotary convention shows
        for layer in ours.layers.values():
            layer.attention.wq.weight.mul_(4)
            layer.attention.wk.weight.mul_(4)
    theirs = hf_model(args, ours.state_dict(), attn)
    if args.tie_embeddings:
        assert theirs.lm_head.weight is theirs.model.embed_tokens.weight
    x = tokens(args, b=2, s=20)
    with torch.no_grad():
        expected = theirs(input_ids=x).logits
        got = ours(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@BOTH
def test_hf_round_trip(args):
    ours = build(args)
    state = ours.state_dict()
    theirs = hf_model(args, state)
    back = from_hf_state_dict(theirs.state_dict(), args)
    assert set(back) == set(state)
    for name, t in state.items():
        assert torch.equal(back[name], t), name
    fresh = Transformer(args)
    fresh.load_state_dict(back)  # strict
    assert args_from_hf_config(theirs.config) == args


def test_hf_partial_state_and_unknown_names():
    stage = build(TINY_TIED, layer_ids=[3], embed=False)
    hf = to_hf_state_dict(stage.state_dict(), TINY_TIED)
    assert "lm_head.weight" in hf and "model.layers.3.mlp.down_proj.weight" in hf
    assert set(from_hf_state_dict(hf, TINY_TIED)) == set(stage.state_dict())
    with pytest.raises(KeyError, match="bogus"):
        to_hf_state_dict({"bogus.weight": torch.zeros(1)}, TINY)


@pytest.mark.cuda
@pytest.mark.parametrize("window", [0, 100])
def test_cuda_flex_documents_equal_the_mask(window):
    """On a GPU, packed rows (random document lengths) through the model in bf16 with
    doc_attention = flex (compiled flex_attention, a block mask, no s × s mask: what CUDA runs)
    and = mask (SDPA with the boolean mask) from the same weights: logits and every gradient
    within 2e-2 of the largest element (bf16 rounds each attention's output to 8 bits,
    2⁻⁸ ≈ 4e-3, and the two kernels round in other places; four layers)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    b, s = 2, 512
    g = torch.Generator().manual_seed(0)
    tok = torch.randint(0, TINY.vocab_size, (b, s), generator=g).cuda()
    docs = (torch.rand(b, s, generator=g) < 0.01).long().cumsum(-1).cuda()
    positions = torch.stack([torch.arange(s) for _ in range(b)]).cuda()
    results = {}
    for documents in ("mask", "flex"):
        args = TINY.with_(dim=256, n_heads=4, n_kv_heads=2, max_seq_len=s, sliding_window=window,
                          doc_attention=documents)
        model = build(args).cuda().to(torch.bfloat16)
        logits = model(tok, positions=positions, doc_ids=docs)
        logits.float().pow(2).mean().backward()
        results[documents] = [logits.detach().float()] + [p.grad.float() for p in model.parameters()]
    for mine, theirs in zip(results["flex"], results["mask"]):
        assert torch.isfinite(mine).all()
        assert (mine - theirs).abs().max() <= 2e-2 * theirs.abs().max()
