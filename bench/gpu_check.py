"""The prepared accelerator check: is the core exact there, and what does a verify step cost (on a CPU the batch-8
speedups are bound by that cost; CI has no GPU, and time on one is short: one prepared run).

The default model's GGUF (98 MB) is more than a device run carries, so this builds a model of its shape
(SmolLM2-135M: 30 layers, 576 wide, 9 query and 3 key/value heads, vocabulary 49152) with random weights, its
lm_head sharpened so that greedy text repeats itself and the drafters have something to copy. Same shapes,
same step costs; and an exact oracle:

1. exactness: greedy outputs of `none`, `ngram` and `suffix` at batch 1 and 8, each against `none` at the same
   batch size (speculation must not change a token) and against Hugging Face `generate` at batch 1, in float32
   (TF32 off) and in the device's default dtype (bfloat16 on CUDA, where batch shapes may flip near-ties: info);
2. step costs at batch 8 (bench_step_costs.py's T, P, J): pass them to bench_replay.py --padding-costs to see
   what a stored job would gain on this device;
3. none against suffix at batch 8 on these prompts, wall clock, medians of --rounds;
4. int4 weights (`--int4`, on by default): the model's linear layers as spec_batch.loading.quant_linear
   Int4Linear (tinygemm `_weight_int4pack_mm` on CUDA, bf16 activations), checked against its own dequantized
   weights, then greedy `none` vs `suffix` at batch 1 and 8 on the int4 model (speculation must not change a
   token), and none vs suffix at batch 8, wall clock. Not yet run on a GPU: the CUDA kernel's layout is gpt-fast's.

    python -m bench.gpu_check --device cuda --out DIR      # prints a report, writes DIR/gpu_check.json

On a device machine whose python has torch and transformers but not this project's other needs, carry the
wheels of this project's transformers, platformdirs and llguidance (requirements.lock's versions), fetched here
once (`echo /.whl/ >> .git/info/exclude` first):

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_31_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
        transformers==5.23.0 platformdirs==4.14.8 llguidance==1.9.1

and run there (carrying .whl; about 5 minutes, mostly the batch-1 loops of 16 prompts x 96 tokens x 2 dtypes):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
        && PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 python3 -m bench.gpu_check --device cuda --out $OUT

Checked here in a fresh virtual environment holding only torch and the device's transformers dependencies
(huggingface_hub 1.33, tokenizers 0.23.2, safetensors 0.8) plus those three wheels. Exit status 1 if
speculation changed any float32 token.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bench.bench_step_costs import fit, mixes, time_mixes
from spec_batch.core.heads.head import head_for_target
from spec_batch.core.params import SamplingParams
from spec_batch.loading import build_decoder
from spec_batch.loading.load import resolve_dtype

SMOLLM2_135M = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    rope_theta=100000.0,
)
EOS = 2


class IdTokenizer:
    """Token ids as text ("12 7 3"): all the decoder needs of a tokenizer for prompts given as ids."""

    eos_token_id = EOS
    pad_token_id = EOS

    def encode(self, text: str, **kwargs) -> list[int]:
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens: bool = True, **kwargs) -> str:
        return " ".join(str(int(i)) for i in ids if not (skip_special_tokens and int(i) == EOS))


def random_model(device: torch.device, dtype: torch.dtype, seed: int, sharpen: float) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M, bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS))
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)  # tied to the embedding: sharper logits, repetitive greedy text
    return model.to(device=device, dtype=dtype).eval()


def prompts(count: int, seed: int, vocab: int = SMOLLM2_135M["vocab_size"]) -> list[list[int]]:
    """Prompts that repeat a passage of their own, as an edit's prompt repeats the text it edits."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        passage = [rng.randrange(3, vocab) for _ in range(rng.randrange(40, 120))]
        out.append([1] + passage + [rng.randrange(3, vocab) for _ in range(8)] + passage[: rng.randrange(5, 20)])
    return out


def hf_greedy(model, ids: list[int], max_new: int, device: torch.device) -> list[int]:
    x = torch.tensor([ids], device=device)
    with torch.inference_mode():
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=EOS,
            pad_token_id=EOS,
        )[0, len(ids) :].tolist()
    return out[: out.index(EOS)] if EOS in out else out


def _draft(model, draft: str):
    """A drafter name, or for "head" ("head3": EAGLE-3's layout, reading three layers) an untrained draft head over
    a quarter of the vocabulary (its drafts are mostly wrong: the check is that its outputs are exact, and the speed
    row what a head step costs)."""
    if draft not in ("head", "head3"):
        return draft
    torch.manual_seed(0)
    vocab = model.get_output_embeddings().weight.shape[0]
    layout = "eagle3" if draft == "head3" else "eagle"
    return head_for_target(model, torch.arange(0, vocab, 4), "random", layout=layout).to(model.dtype)


def check_exactness(model, device: torch.device, ps: list[list[int]], max_new: int) -> dict:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    reference = [hf_greedy(model, p, max_new, device) for p in ps]
    report: dict = {}
    for batch in (1, 8):
        outputs = {}
        for draft in ("none", "ngram", "suffix", "head", "head tree", "head3 tree"):
            tree = (
                3 if draft.endswith(" tree") else 1
            )  # trees of width 3 (at every batch here: their masks are checked)
            dec = build_decoder(
                model,
                IdTokenizer(),
                target_name="random",
                draft=_draft(model, draft.split()[0]),
                device=device,
                tree_width=tree,
            )
            dec.policy.tree_batch = batch
            outputs[draft] = [list(r.token_ids) for r in dec.generate(ps, params, batch_size=batch)]
        for draft, outs in outputs.items():
            report[f"{draft} b{batch}"] = {
                "same as none at this batch": sum(o == n for o, n in zip(outs, outputs["none"])),
                "same as HF b1": sum(o[: len(r)] == r for o, r in zip(outs, reference)),
                "prompts": len(ps),
            }
    return report


def speed(model, device: torch.device, ps: list[list[int]], max_new: int, rounds: int) -> dict:
    params = SamplingParams(max_new_tokens=max_new, temperature=0.0)
    decs = {
        d: build_decoder(
            model, IdTokenizer(), target_name="random", draft=_draft(model, d), device=device, adaptive=d != "head"
        )
        for d in ("none", "suffix", "head")
    }
    seconds: dict[str, list[float]] = {d: [] for d in decs}
    for r in range(rounds + 1):  # the first round warms kernels and the policy's step costs
        for name, dec in decs.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            dec.generate(ps, params, batch_size=8)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r:
                seconds[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(s) for name, s in seconds.items()}
    return {
        "seconds": med,
        "suffix vs none": med["none"] / med["suffix"],
        "head (always drafting) vs none": med["none"] / med["head"],
    }


def check_int4(model, device: torch.device, ps: list[list[int]], max_new: int, rounds: int) -> dict:
    """The int4 copy of the model: its layers against their dequantized weights, speculation exact against plain
    decoding with the same int4 kernels, and its speed."""
    import copy

    from spec_batch.loading.quant_linear import Int4Linear
    from spec_batch.loading.weights import quantize_model

    qmodel = copy.deepcopy(model).to(torch.bfloat16)
    quantize_model(qmodel, "int4", torch.bfloat16)
    layer = next(m for m in qmodel.modules() if isinstance(m, Int4Linear))
    x = torch.randn(8, layer.in_features, device=device, dtype=torch.bfloat16)
    want = x.float() @ layer.dequantized().t()
    err = float((layer(x).float() - want).abs().max() / want.abs().max().clamp_min(1e-6))
    exact = {k: v for k, v in check_exactness(qmodel, device, ps, max_new).items()}
    ok = all(v["same as none at this batch"] == v["prompts"] for v in exact.values())
    return {
        "layer relative error": err,
        "exactness": exact,
        "exact": ok,
        "speed b8": speed(qmodel, device, ps, max_new, rounds),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds of the speed check")
    ap.add_argument("--sharpen", type=float, default=12.0, help="lm_head scale of the random model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="folder for gpu_check.json")
    ap.add_argument("--no-int4", dest="int4", action="store_false", help="skip the int4 weights check")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 for the exactness check
        torch.backends.cudnn.allow_tf32 = False
    ps = prompts(args.prompts, args.seed)
    result: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    exact_ok = True
    for dtype in dict.fromkeys([torch.float32, resolve_dtype("auto", device)]):
        model = random_model(device, dtype, args.seed, args.sharpen)
        report = check_exactness(model, device, ps, args.max_new_tokens)
        result[f"exactness {dtype}"] = report
        if dtype == torch.float32:
            exact_ok = all(v["same as none at this batch"] == v["prompts"] for v in report.values())
        samples = time_mixes(
            model, EOS, SMOLLM2_135M["vocab_size"], device, 8, 300, mixes(8, 30, random.Random(args.seed)), 5, args.seed
        )
        base, t, p, j = fit(samples)
        result[f"step costs b8 {dtype}"] = {"plain step ms": base * 1000, "padding-costs": f"{t:.4f},{p:.4f},{j:.4f}"}
        result[f"speed b8 {dtype}"] = speed(model, device, ps, args.max_new_tokens, args.rounds)
        print(json.dumps({k: v for k, v in result.items() if str(dtype) in k}, indent=1), flush=True)
    if args.int4:
        result["int4"] = check_int4(
            random_model(device, torch.float32, args.seed, args.sharpen), device, ps, args.max_new_tokens, args.rounds
        )
        exact_ok = exact_ok and result["int4"]["exact"]
        print(json.dumps({"int4": result["int4"]}, indent=1), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(f"# exact in float32 on {result['device']}: {'yes' if exact_ok else 'NO'}")
    return 0 if exact_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
