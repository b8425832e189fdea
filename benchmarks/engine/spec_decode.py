"""Speculative decoding on the reference engine, in one run: the host drafter (eager, sync: drafts, rows and
acceptance on the engine thread) against the device drafter (inside the step: one CUDA graph a step, async
scheduling), with plain decoding as the reference.

    python benchmarks/engine/spec_decode.py                        # qwen3-4b, batch 1 and 4, k = 2, 4, 8
    python benchmarks/engine/spec_decode.py --preset tiny --tokens 24 # smoke run (on a CPU: eager only)

Every arm generates --tokens greedy tokens per request from the same prompts (a text that repeats, so prompt
lookup finds drafts) on one shared set of weights. Reported: ms per generated token of a request (the wall
time of the whole generation after a warm-up, divided by the tokens each request got), tokens a request gains
a decode step (prefill's first token included), drafts accepted / proposed, decode steps, and how many tokens
equal the plain step graph's before the first difference (verify rows run other kernels than one-row decode
steps, so bf16 rounding may part them; at batch 1 the logits of both tokens at the first difference are
printed, from a prefill forward). Writes spec_decode.json under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from engine_decode import sync  # noqa: E402  (this directory is on sys.path when run as a script)

from reference_engine.config import Config  # noqa: E402
from reference_engine.engine import Engine, SamplingParams  # noqa: E402
from reference_engine.kernels import torch_ref  # noqa: E402
from reference_engine.kv_cache import allocate_kv_cache  # noqa: E402
from reference_engine.model import AttentionMetadata, Qwen3Model  # noqa: E402


def prompts(batch: int, length: int, period: int) -> list[list[int]]:
    """Texts that repeat a `period`-token phrase (a different phrase per request)."""
    return [[(31 * i + j % period) % 1000 + 3 for j in range(length)] for i in range(batch)]


def arms(ks: list[int], cuda: bool) -> dict[str, dict]:
    """Configurations by name; the first is the reference. The device drafter also runs eagerly once, with
    async scheduling as its graph (the same kernels and batches: the graph must give its tokens; sync
    scheduling drops a finished sequence one step earlier, and the batch's shape changes the others'
    rounding)."""
    graph, graphed = ("step", "one graph a step") if cuda else ("eager", "eager (no CUDA)")
    out = {
        f"plain, {graphed}, async": dict(graph=graph, async_scheduling=True),
        "plain, eager, sync": dict(graph="eager"),
    }
    for k in ks:
        out[f"host drafter k={k}, eager, sync"] = dict(graph="eager", spec_tokens=k)
        if cuda and k == ks[0]:
            out[f"device drafter k={k}, eager, async"] = dict(graph="eager", async_scheduling=True,
                                                              spec_tokens=k, drafter="device")
        out[f"device drafter k={k}, {graphed}, async"] = dict(graph=graph, async_scheduling=True,
                                                               spec_tokens=k, drafter="device")
        if cuda and k == ks[0]:  # the drafts and acceptance as ~70 torch kernels instead of two launches
            out[f"device drafter k={k}, {graphed}, async, torch spec ops"] = dict(
                graph=graph, async_scheduling=True, spec_tokens=k, drafter="device", spec_ops="torch")
    return out


def run_arm(model: Qwen3Model, base: Config, changes: dict, batch: int, args) -> dict:
    changes = dict(changes)
    spec_ops = changes.pop("spec_ops", None)
    engine = Engine(base.replace(**changes), model=model)
    if spec_ops == "torch":
        engine.model.ops = dataclasses.replace(engine.model.ops, spec_rows=torch_ref.spec_rows,
                                               spec_accept=torch_ref.spec_accept)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    texts = prompts(batch, args.prompt_len, args.period)
    engine.generate(texts, SamplingParams(max_tokens=24, ignore_eos=True))  # graphs captured, kernels built
    before = dict(engine.stats.as_dict())
    sync()
    start = time.perf_counter()
    outputs = engine.generate(texts, params)
    sync()
    seconds = time.perf_counter() - start
    stats = {key: value - before[key] for key, value in engine.stats.as_dict().items()}
    engine.shutdown()
    return {
        "ms_per_token": seconds / args.tokens * 1e3,
        "tokens_per_step": stats["tokens_generated"] / max(stats["decode_steps"], 1) / batch,
        "decode_steps": stats["decode_steps"],
        "drafts": stats["draft_tokens"],
        "accepted": stats["accepted_tokens"],
        "replays": stats["graph_replays"],
        "outputs": outputs,
    }


def first_difference(model: Qwen3Model, base: Config, prompt: list[int], reference: list[int],
                     output: list[int]) -> dict | None:
    """Where `output` first parts from `reference` (one request): the index and both tokens' logits there,
    computed by a prefill forward over the prompt and the reference's tokens before it (a third kernel path:
    near-ties show as logits within rounding of each other)."""
    index = next((i for i, (a, b) in enumerate(zip(reference, output, strict=False)) if a != b), None)
    if index is None:
        return None
    tokens = prompt + reference[:index]
    caches = allocate_kv_cache(base, dtype=model.dtype)
    device = model.embed.device
    ids = torch.tensor(tokens, device=device)
    positions = torch.arange(len(tokens), device=device)
    meta = AttentionMetadata(positions + base.block_size, cu_seqlens=[0, len(tokens)])  # blocks 1, 2, ...
    logits = model.compute_logits(model.forward(ids, positions, caches, meta)[-1:]).float()[0]
    return {"index": index, "reference_logit": logits[reference[index]].item(),
            "arm_logit": logits[output[index]].item(), "logit_std": logits.std().item()}


def matching(outputs: list[list[int]], reference: list[list[int]]) -> int:
    """Tokens equal to the reference's before each request's first difference, summed."""
    same = 0
    for got, want in zip(outputs, reference, strict=True):
        for a, b in zip(got, want, strict=False):
            if a != b:
                break
            same += 1
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--spec-tokens", default="2,4,8", help="draft lengths k, comma-separated")
    parser.add_argument("--tokens", type=int, default=256, help="generated tokens per request")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--period", type=int, default=24, help="length of the prompts' repeated phrase")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    try:
        ks = [int(k) for k in args.spec_tokens.split(",")]
        batches = [int(b) for b in args.batches.split(",")]
        base = Config(preset=args.preset, max_model_len=args.max_model_len)
    except ValueError as exc:
        parser.error(str(exc))
    if args.prompt_len + args.tokens + 24 > args.max_model_len:
        parser.error("--prompt-len + --tokens (+ 24 warm-up) must fit --max-model-len")
    cuda = base.device == "cuda"
    model = Qwen3Model.random(base)
    out = {"preset": args.preset, "device": torch.cuda.get_device_name() if cuda else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "tokens": args.tokens, "prompt_len": args.prompt_len, "period": args.period, "rows": []}
    twins = []  # the device drafter's graph against its eager run: the same kernels, so the same tokens
    for batch in batches:
        reference, by_arm = None, {}
        for name, changes in arms(ks, cuda).items():
            result = run_arm(model, base, changes, batch, args)
            outputs = by_arm[name] = result.pop("outputs")
            reference = reference or outputs
            result.update(arm=name, batch=batch, same_tokens=matching(outputs, reference),
                          all_tokens=sum(len(o) for o in reference))
            if batch == 1:
                texts = prompts(1, args.prompt_len, args.period)
                result["first_difference"] = first_difference(model, base, texts[0], reference[0], outputs[0])
            out["rows"].append(result)
            print(f"b={batch} {name}: {result['ms_per_token']:.3f} ms/token", flush=True)
        eager = f"device drafter k={ks[0]}, eager, async"
        if eager in by_arm:
            graphed = by_arm[f"device drafter k={ks[0]}, one graph a step, async"]
            twins.append(f"b={batch}: {matching(graphed, by_arm[eager])}/{sum(map(len, by_arm[eager]))}")
    out["graph_equals_eager"] = twins
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "spec_decode.json").write_text(json.dumps(out, indent=2))
    print(f"\n{args.preset} on {out['device']} ({out['date']}), {args.tokens} greedy tokens a request after "
          f"a {args.prompt_len}-token prompt repeating a {args.period}-token phrase")
    print(f"{'arm':<46} {'batch':>5} {'ms/token':>9} {'tok/step':>8} {'accepted':>13} {'steps':>6} "
          f"{'same as plain':>14}")
    for row in out["rows"]:
        accepted = f"{row['accepted']}/{row['drafts']}" if row["drafts"] else "-"
        print(f"{row['arm']:<46} {row['batch']:>5} {row['ms_per_token']:>9.3f} "
              f"{row['tokens_per_step']:>8.2f} {accepted:>13} {row['decode_steps']:>6} "
              f"{row['same_tokens']:>6}/{row['all_tokens']:<7}")
    for row in out["rows"]:
        if row.get("first_difference"):
            d = row["first_difference"]
            print(f"b=1 {row['arm']}: first difference at token {d['index']}, logits there "
                  f"{d['reference_logit']:.4f} (plain's token) / {d['arm_logit']:.4f} (this arm's), "
                  f"logit std {d['logit_std']:.2f}")
    if twins:
        print(f"device drafter k={ks[0]}, one graph a step, async: tokens equal to its eager, async run: "
              f"{', '.join(twins)}")


if __name__ == "__main__":
    main()
