"""Would torch.compile pay for our forward on this CPU? Eager against inductor-compiled layer regions, side by side.

Question (issue 37, "compiled"): with the default model at w4a8, does compiling each layer's elementwise work
around the native linears (RMSNorm + q/k/v + rotary; o-projection + residual + RMSNorm + gate/up + SiLU + down)
make a decode step faster, what does the first compile cost, and are the logits the same bits?

    .venv/bin/python -m bench.bench_compile [--weights w4a8] [--threads 2] [--set edits] [--n 4]
        [--max-tokens 48] [--rounds 3] [--dynamic]

Attention and the KV cache stay eager (the native attention kernel is opaque to inductor); the w4a8 linear gets a
fake implementation here so that inductor can trace around it. Plain decoding (draft none) at batch 1, greedy,
the two forwards interleaved per round; prints each round, then medians and the share of outputs equal to the
eager forward's. Not used by spec-batch: a measurement of the option (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from bench.prompts import SETS
from spec_batch import SamplingParams, load_decoder
from spec_batch.loading.block_linear import TILE
from spec_batch.loading.llama_forward import LlamaForward, _projections


def _register_fakes() -> None:
    """Shapes of the native ops for tracing (their CPU kernels run at execution)."""

    @torch.library.register_fake("spec_batch::w4a8_linear")
    def _(x, weight, d, m, portable=False):
        return x.new_empty((x.shape[0], weight.shape[0] * TILE), dtype=torch.float32)


class CompiledRegions(LlamaForward):
    """Our forward with each layer's two attention-free regions compiled by inductor (one graph for all layers:
    modules are graph inputs)."""

    def __init__(self, model: Any, dynamic: bool) -> None:
        super().__init__(model)
        self._pre = torch.compile(self._before_attention, dynamic=dynamic)
        self._post = torch.compile(self._after_attention, dynamic=dynamic)

    def _before_attention(self, layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self._queries_keys_values(layer.self_attn, layer.input_layernorm(x), (cos, sin))

    def _after_attention(self, layer: Any, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        x = x + layer.self_attn.o_proj(out)
        h = layer.post_attention_layernorm(x)
        gate, up = _projections(layer.mlp, ("gate_proj", "up_proj"), "gate_up_proj", h)
        return x + layer.mlp.down_proj(layer.mlp.act_fn(gate) * up)

    def _layer(self, index: int, layer: Any, x: torch.Tensor, rotary: tuple, visible: torch.Tensor, cache: Any):
        rows, width, _ = x.shape
        q, k, v = self._pre(layer, x, *rotary)
        keys, values = cache.update(k, v, index)
        out = torch.ops.spec_batch.attend(q, keys, values, visible, torch.empty(0), self.scale)
        return self._post(layer, x, out.reshape(rows, width, -1).contiguous())


def _decode(dec: Any, prompts: list, params: SamplingParams) -> tuple[float, list[list[int]], int]:
    start = time.perf_counter()
    results = dec.generate(prompts, params, batch_size=1)
    wall = time.perf_counter() - start
    return wall, [r.token_ids for r in results], sum(len(r.token_ids) for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", default="w4a8")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--set", default="edits", choices=sorted(SETS))
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dynamic", action="store_true", help="compile for any width (default: per shape)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dec = load_decoder("default", draft="none", weights=args.weights)
    _register_fakes()  # the op exists once loading has built the native kernels
    model = dec.target
    eager = model.spec_batch_forward
    if eager is None:
        raise SystemExit("our forward does not apply here (needs the native kernels: SPEC_BATCH_COMPILE)")
    compiled = CompiledRegions(model, args.dynamic)
    prompts = [dec.apply_chat_template([{"role": "user", "content": p}]) for p in SETS[args.set][: args.n]]
    params = SamplingParams(max_new_tokens=args.max_tokens)
    model.spec_batch_forward = compiled
    start = time.perf_counter()
    _decode(dec, prompts[:1], SamplingParams(max_new_tokens=4))
    print(f"first compiled call (compiles): {time.perf_counter() - start:.1f} s")
    rates: dict[str, list[float]] = {"eager": [], "compiled": []}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for name, forward in (("eager", eager), ("compiled", compiled)):
            model.spec_batch_forward = forward
            wall, outputs[name], tokens = _decode(dec, prompts, params)
            rates[name].append(tokens / wall)
            print(f"round {r + 1} {name:>8}: {tokens / wall:6.1f} tok/s ({tokens} tokens, {wall:.2f} s)")
    model.spec_batch_forward = eager
    same = sum(a == b for a, b in zip(outputs["eager"], outputs["compiled"]))
    e, c = statistics.median(rates["eager"]), statistics.median(rates["compiled"])
    print(f"median: eager {e:.1f} tok/s, compiled {c:.1f} tok/s: compiled/eager {c / e:.2f}x")
    print(f"outputs equal to the eager forward's: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
