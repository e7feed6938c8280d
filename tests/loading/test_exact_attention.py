"""A token's logits do not depend on the step that computes it: one token at a time, or inside a verify step of
several tokens, beside other ragged rows, after a rollback -- bit for bit, at every weight storage and compute dtype
the CPU offers (loading/cpu_attention.py: attention computes in float64 there)."""

from __future__ import annotations

import pytest
import torch

from spec_batch.core.kv.kv_batch import KVBatch, left_padded
from spec_batch.loading.cpu_attention import attention_kind
from spec_batch.loading.kernels import native_ops

CPU = torch.device("cpu")
PROMPT, OTHER, TOKENS = [5, 9, 11, 3, 7, 1, 30, 2, 17], [8, 2, 6], [4, 12, 13, 14, 40]


def _one_at_a_time(model) -> torch.Tensor:
    kv = KVBatch(model, CPU, 1)
    ids, valid = left_padded([PROMPT], 0, CPU)
    out = []
    with torch.inference_mode():
        kv.forward(ids, valid)
        for token in TOKENS:
            out.append(kv.forward(torch.tensor([[token]]), torch.ones(1, 1, dtype=torch.bool))[0, -1])
    return torch.stack(out)


def _in_a_verify_step(model) -> torch.Tensor:
    """Beside a shorter row, after two rejected tokens (a hole in the cache), all tokens in one step."""
    kv = KVBatch(model, CPU, 2)
    ids, valid = left_padded([PROMPT, OTHER], 0, CPU)
    with torch.inference_mode():
        kv.forward(ids, valid)
        kv.forward(torch.tensor([[50, 51], [52, 53]]), torch.ones(2, 2, dtype=torch.bool))
        kv.rollback(torch.tensor([2, 1]))
        step = torch.tensor([TOKENS, [60, 61, 0, 0, 0]])
        return kv.forward(step, step != 0)[0]


@pytest.mark.parametrize(
    "weights,dtype",
    [
        ("full", torch.float32),
        ("full", torch.bfloat16),
        ("int4", torch.float32),
        ("int8", torch.float32),
        ("int4", torch.bfloat16),
        ("w4a8", torch.float32),
        ("w4a8", torch.bfloat16),
    ],
)
@pytest.mark.parametrize("native", [False, True], ids=["float64", "native"])
def test_a_tokens_logits_are_the_same_bits_in_any_step(weights, dtype, native, prepared_llama):
    if (native or weights == "w4a8") and not native_ops():
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    model = prepared_llama(weights, dtype, native)
    assert attention_kind(model) == ("native" if native else "float64")
    alone, verified = _one_at_a_time(model), _in_a_verify_step(model)
    assert torch.equal(alone, verified), (alone - verified).abs().max()


def test_the_cache_is_kept_in_float64_and_attention_returns_the_models_dtype(prepared_llama):
    model = prepared_llama("int4", torch.float32, False)
    kv = KVBatch(model, CPU, 1)
    with torch.inference_mode():
        logits = kv.forward(torch.tensor([PROMPT]), torch.ones(1, len(PROMPT), dtype=torch.bool))
    assert kv.cache.layers[0].keys.dtype == torch.float64
    assert logits.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_attention_keeps_the_cache_in_the_models_dtype_and_agrees_with_float64(dtype, prepared_llama):
    if not native_ops():
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    native, reference = prepared_llama("full", dtype, True), prepared_llama("full", dtype, False)
    kv, ref = KVBatch(native, CPU, 1), KVBatch(reference, CPU, 1)
    ids, valid = left_padded([PROMPT], 0, CPU)
    with torch.inference_mode():
        got, want = kv.forward(ids, valid), ref.forward(ids, valid)
    assert kv.cache.layers[0].keys.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    assert (got.float() - want.float()).abs().max() < tolerance * want.float().abs().max()


def test_the_native_kernel_matches_a_reference_and_reads_only_visible_columns():
    if not native_ops():
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    torch.manual_seed(3)
    q, k, v = torch.randn(2, 6, 4, 32), torch.randn(2, 3, 20, 32), torch.randn(2, 3, 20, 32)
    visible = torch.rand(2, 1, 4, 20) > 0.4
    visible[..., 0] = True
    out = torch.ops.spec_batch.attend(q, k, v, visible, torch.empty(0), 0.2)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), attn_mask=visible, scale=0.2
    ).transpose(1, 2)
    assert (out - want).abs().max() < 1e-5
    k2, v2 = k.clone(), v.clone()
    k2[~visible[:, 0, 0].unsqueeze(1).unsqueeze(-1).expand_as(k)] = float("nan")  # hidden from query 0 only
    v2[~visible[:, 0, 0].unsqueeze(1).unsqueeze(-1).expand_as(v)] = float("nan")
    alone = torch.ops.spec_batch.attend(q[:, :, :1], k2, v2, visible[:, :, :1], torch.empty(0), 0.2)
    assert torch.equal(alone[:, 0], out[:, 0])


def test_compile_off_selects_the_float64_path_and_a_bad_choice_is_refused():
    assert native_ops("off") is False
    with pytest.raises(ValueError, match="compile='sometimes'"):
        native_ops("sometimes")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128, 72, 16])
def test_the_vector_path_gives_the_portable_paths_bits(dtype, dim):
    """The AVX-512 path (dot products, exp, weighted sums in registers; where the CPU has it) against the plain C++
    one, whose exp is the C library's: the same bits, with and without a bias, with masks per head, with padded
    queries that see nothing, and with scores spread far enough that exp leaves its vector range."""
    if not native_ops():
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    torch.manual_seed(dim)
    q = (torch.randn(3, 6, 5, dim) * 4).to(dtype)
    k, v = torch.randn(3, 2, 70, dim).to(dtype), torch.randn(3, 2, 70, dim).to(dtype)
    shared, per_head = torch.rand(3, 1, 5, 70) > 0.3, torch.rand(3, 6, 5, 70) > 0.5
    shared[1, 0, :3] = False  # padded queries
    bias = torch.randn(3, 1, 5, 70) * 30
    for visible, extra in [(shared, torch.empty(0)), (per_head, torch.empty(0)), (shared, bias)]:
        fast = torch.ops.spec_batch.attend(q, k, v, visible, extra, 0.3)
        plain = torch.ops.spec_batch.attend(q, k, v, visible, extra, 0.3, True)
        assert torch.equal(fast, plain) and torch.equal(fast.signbit(), plain.signbit())
    assert not fast[1, :3].any()  # a query that sees nothing gets zeros


def test_a_steps_cache_write_and_attention_in_one_call_give_the_two_calls_bits():
    """attend_appended (the own forward's decode step) writes the new keys and values into the slab's next columns
    and attends over the first length + n: the same bits as SlabLayer.update followed by attend."""
    if not native_ops():
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    from spec_batch.core.kv.kv_batch import SlabLayer

    gen = torch.Generator().manual_seed(3)
    prompt_k, prompt_v = (torch.randn(2, 3, 40, 64, generator=gen) for _ in range(2))
    k, v, q = torch.randn(2, 3, 4, 64, generator=gen), torch.randn(2, 3, 4, 64, generator=gen), torch.randn(2, 9, 4, 64)
    visible = torch.rand(2, 1, 4, 44, generator=gen) > 0.2
    fused, plain = SlabLayer(), SlabLayer()
    for layer in (fused, plain):
        layer.update(prompt_k, prompt_v)
    key_slab, value_slab, length = fused.room(4)
    assert length == 40 and key_slab.shape[2] >= 44
    got = torch.ops.spec_batch.attend_appended(q, k, v, key_slab, value_slab, length, visible, torch.empty(0), 0.125)
    fused.advance(4)
    keys, values = plain.update(k, v)
    assert torch.equal(got, torch.ops.spec_batch.attend(q, keys, values, visible, torch.empty(0), 0.125))
    assert torch.equal(fused.keys, keys) and torch.equal(fused.values, values) and fused.get_seq_length() == 44
    with pytest.raises(AttributeError, match="first `length` columns"):
        fused.keys = keys  # the slab is the storage: an assignment would not reach it
