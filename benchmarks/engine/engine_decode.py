"""Decode step time of the reference engine against the HBM floor and Hugging Face transformers, in one run.

    python benchmarks/engine/engine_decode.py       # qwen3-4b, every graph mode x kernel x batch 1/2/4/8
    python benchmarks/engine/engine_decode.py --check # first compare greedy outputs (eager == step, ...)
    python benchmarks/engine/engine_decode.py --preset tiny --batches 1 --no-hf   # quick smoke run

Needs CUDA for meaningful numbers (on a CPU it runs eager only). Everything is measured side by side here:
- floor: bytes of weights a decode step reads / device copy bandwidth measured in this run;
- engine: wall time per `Engine.step()` in sync mode (CPU + GPU, nothing overlapped), and the step graph's GPU
  time alone (back-to-back replays), so the gap is the CPU's exposed share;
- transformers: the same shape (Qwen3 config, random weights built locally), batch 1, eager with a dynamic
  cache, and static cache + a CUDA graph of the decode forward captured by hand.
Writes results.json under --out and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from reference_engine import graphs
from reference_engine.config import Config
from reference_engine.engine import Engine, SamplingParams
from reference_engine.kernels import decode_layers, decode_linear, skinny_gemm
from reference_engine.model import Qwen3Model

GEMM_VARIANTS = {  # name: config rewrite (cfg, n, k, rows, silu) -> cfg, applied on top of choose_config
    "default": None,
    "dot-no-pdl": lambda cfg, n, k, rows, silu: cfg if cfg.fma else dataclasses.replace(cfg, pdl=False),
    "gate-up-pdl": lambda cfg, n, k, rows, silu: dataclasses.replace(cfg, pdl=True) if silu else cfg,
    # one-row layers (default: every layer in one launch, decode_layers.py; else attention, then the rest
    # of a layer in fused_mlp.py's launches):
    "tail-without-qkv": None,  # o_proj + MLP in one launch, the next qkv separate
    "mlp-launch": None,  # o_proj, the MLP in one launch, qkv
    "separate-launches": None,  # o_proj, gate_up, down, qkv
    "layer-launches": None,  # a launch per layer for attention and one for the rest (o_proj, MLP, next qkv)
    # the one launch with decode_layers.OPTIONS changed (_LAUNCH_OPTIONS):
    "o-walk": None,  # o_proj walks its K chunks as attention fills them (not holding its whole tile)
    "o-pairs": None,  # each o_proj program holds one tile across attention and streams a second after it
    "o-no-ahead": None,  # o_proj's first half does not ask L2 for the second half's weights
    "embedding-launch": None,  # the embedding gather in its own launch (not with decode_inputs)
}
_LAUNCH_OPTIONS = {"o-walk": {"o_proj_whole": False}, "o-pairs": {"o_proj_tiles": 2},
                   "o-no-ahead": {"o_ahead": False}}
_DECODE_LAYERS_OPTIONS = dict(decode_layers.OPTIONS)
_LAYER_TAIL = {"tail-without-qkv": "o+mlp", "mlp-launch": "mlp", "separate-launches": "off",
               "layer-launches": "o+mlp+qkv"}
_CHOOSE_CONFIG = skinny_gemm.choose_config  # the engine's own, restored before each variant


def gemm_tiles(path: Path):
    """Benchmark-only: a rewrite giving the engine's decode GEMMs the tiles a skinny_gemm_sweep.py --json run
    chose."""
    table = {}
    for row in json.loads(path.read_text())["shapes"]:
        silu = row["shape"].startswith("gate_up")
        n = row["n"] // 2 if silu else row["n"]
        table[(n, row["k"], row["rows"], silu)] = skinny_gemm.GemmConfig(**(row["pdl_best"] or row["best"]))
    return lambda cfg, n, k, rows, silu: table.get((n, k, rows, silu)) or cfg


def apply_gemm_variant(name: str, tiles=None) -> dict:
    """Benchmark-only: rewrite the engine's decode GEMM tiles (or how the layer after attention launches),
    then apply `tiles` (a gemm_tiles rewrite) on top, to compare designs in whole steps. Each call starts
    from the engine's own choices (variants run one after another in one process). Returns the Config
    changes the variant needs (the layer-tail variants launch layers one by one)."""
    skinny_gemm.choose_config = _CHOOSE_CONFIG
    decode_linear.FUSED_MLP["mode"] = _LAYER_TAIL.get(name, "o+mlp+qkv")
    graphs.EMBED_WITH_INPUTS["on"] = name != "embedding-launch"
    decode_layers.OPTIONS.update(_DECODE_LAYERS_OPTIONS, **_LAUNCH_OPTIONS.get(name, {}))
    for rewrite in (GEMM_VARIANTS[name], tiles):
        if rewrite is not None:
            rewrite_gemm_configs(rewrite)
    return dict(one_launch_layers=name not in _LAYER_TAIL)


def rewrite_gemm_configs(rewrite) -> None:
    """Patch skinny_gemm.choose_config: rewrite(cfg, n, k, rows, silu) -> cfg on top of its choice."""
    chosen = skinny_gemm.choose_config

    def patched(n: int, k: int, rows: int, *, silu: bool = False):
        return skinny_gemm._fit(rewrite(chosen(n, k, rows, silu=silu), n, k, rows, silu), k)

    skinny_gemm.choose_config = patched


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), 2 GiB buffers."""
    if device != "cuda":
        return float("nan")
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    sync()
    seconds = start.elapsed_time(end) / 1e3 / 20
    del src, dst
    return 2 * 2**31 / seconds


def engine_for(model: Qwen3Model, base: Config, **changes) -> Engine:
    """An engine over the shared weights (the engine rebinds kernels to its own config)."""
    return Engine(base.replace(**changes), model=model)


def time_decode(engine: Engine, batch: int, steps: int, prompt_len: int) -> dict:
    """ms per decode step (sync), after prefill and warm-up steps (the step graph is captured on step 2)."""
    params = SamplingParams(max_tokens=steps + 10, ignore_eos=True)
    for i in range(batch):
        engine.submit([(17 * i + j) % 1000 + 3 for j in range(prompt_len)], params)
    warm = engine.stats.decode_steps + 4
    while engine.stats.decode_steps < warm:
        engine.step()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    gpu_ms = float("nan")
    graph = engine.graphs.graphs.get(("step", batch, True))
    if graph is not None:  # the whole step's GPU work alone, replayed back to back
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(engine.stream):
            begin.record()
            for _ in range(steps):
                graph.replay()
            end.record()
        sync()
        gpu_ms = begin.elapsed_time(end) / steps
    while engine.has_work():
        engine.step()
    return {"step_ms": step_ms, "gpu_ms": gpu_ms, "replays": engine.stats.graph_replays}


def breakdown(model: Qwen3Model, base: Config, *, kernels: str, steps: int = 5,
              trace: Path | None = None) -> dict:
    """Where the GPU time of one batch-1 step goes: profiler kernel table of step-graph replays, and the GEMMs
    and LM head timed alone (to compare with what their bytes cost at copy bandwidth)."""
    from torch.profiler import ProfilerActivity, profile

    engine = engine_for(model, base, graph="step", kernels=kernels)
    time_decode(engine, 1, 10, 128)
    # Replays re-run the last step on stale (valid) buffers: fine for timing.
    graph = engine.graphs.graphs[("step", 1, True)]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with torch.cuda.stream(engine.stream):
            for _ in range(steps):
                graph.replay()
        sync()
    table = {}
    for event in prof.key_averages():
        cuda_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if cuda_us > 0 and event.count:
            table[event.key[:60]] = (event.count / steps, cuda_us / steps)
    top = sorted(table.items(), key=lambda kv: -kv[1][1])[:14]
    launches = round(sum(c for c, _ in table.values()))
    print(
        f"step graph kernels per step ({kernels}): {launches} launches, "
        f"{sum(t for _, t in table.values()) / 1e3:.3f} ms (kernel time summed: PDL kernels overlap)"
    )
    for name, (count, us) in top:
        print(f"  {us / 1e3:7.3f} ms  x{count:4.0f}  {name}")
    increments = {}
    if trace is not None:  # per-kernel start/end: what each kernel adds to the step, not its duration
        prof.export_chrome_trace(str(trace))
        increments = step_increments(trace, steps)
        print("what each decode-layer kernel adds to the step (median us; end minus the latest earlier end):")
        for label, (median_us, total_us) in increments.items():
            print(f"  {label:34s} {median_us:7.2f} us  x36 = {total_us / 1e3:.3f} ms")
    del engine
    real_step_timeline(model, base, kernels=kernels,
                       trace=trace.with_name("async_steps.json") if trace else None)

    import triton.testing

    def graph_ms(fn) -> float:  # GPU time under CUDA-graph replay, as in the step graph
        return triton.testing.do_bench_cudagraph(fn, return_mode="median")

    x = torch.randn(1, base.hidden_size, device="cuda", dtype=model.dtype)
    ops, eps, layers = model.ops, base.rms_norm_eps, model.layers
    act = torch.randn(1, base.intermediate_size, device="cuda", dtype=model.dtype)
    att = torch.randn(1, base.num_heads * base.head_dim, device="cuda", dtype=model.dtype)
    linear = torch.nn.functional.linear

    def cublas_layers() -> None:  # every layer's own weights, so they come from HBM as in a step
        for layer in layers:
            linear(x, layer.qkv), linear(att, layer.o_proj), linear(x, layer.gate_up), linear(act, layer.down)

    def fused_layers() -> None:
        for layer in layers:
            ops.norm_linear(x, layer.input_norm, layer.qkv, eps)
            ops.linear_residual(att, layer.o_proj, x)
            ops.norm_gate_up_silu(x, layer.post_norm, layer.gate_up, eps)
            ops.linear_residual(act, layer.down, x)

    cublas_ms, fused_ms = graph_ms(cublas_layers), graph_ms(fused_layers)
    lm_ms = graph_ms(lambda: linear(x, model.lm_head))
    lm_fused_ms = graph_ms(
        lambda: ops.norm_linear(x, model.final_norm, model.lm_head, eps, out_dtype=torch.float32)
    )
    result = {"profile_top": {k: v for k, v in top}, "increments_us": increments,
              "layer_gemms_ms": cublas_ms, "lm_head_ms": lm_ms,
              "layer_fused_ms": fused_ms, "lm_head_fused_ms": lm_fused_ms}
    print(f"GEMMs alone, cuBLAS: layers {cublas_ms:.3f} ms + lm_head {lm_ms:.3f} ms "
          f"= {cublas_ms + lm_ms:.3f} ms")
    print(f"GEMMs alone, {ops.name} ops (norm/SiLU/residual included): layers {fused_ms:.3f} ms + lm_head "
          f"{lm_fused_ms:.3f} ms = {fused_ms + lm_fused_ms:.3f} ms")
    return result


def real_step_timeline(model: Qwen3Model, base: Config, *, kernels: str, trace: Path | None) -> None:
    """The GPU timeline of real step-async engine steps at batch 1 (the metadata copy in, the step graph,
    the tokens' copy out): each kernel's start and end within one step, and the step's period."""
    from torch.profiler import ProfilerActivity, profile

    if trace is None:
        return
    engine = engine_for(model, base, graph="step", kernels=kernels, async_scheduling=True)
    engine.submit([(5 * j) % 1000 + 3 for j in range(128)], SamplingParams(max_tokens=60, ignore_eos=True))
    for _ in range(20):
        engine.step()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
        sync()
    while engine.has_work():
        engine.step()
    prof.export_chrome_trace(str(trace))
    events = sorted((e for e in json.loads(trace.read_text())["traceEvents"]
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    starts = [i for i, e in enumerate(events) if "decode_inputs" in e["name"]]
    if len(starts) < 4:
        return
    first, nxt = starts[2], starts[3]
    t0 = events[first]["ts"]
    print(f"real step-async step at b=1: period {events[nxt]['ts'] - t0:.1f} us (decode_inputs to the next)")
    for e in events[first - 2: nxt]:
        print(f"  {e['name'][:34]:34s} start {e['ts'] - t0:9.2f}  end {e['ts'] + e['dur'] - t0:9.2f}")
    del engine


LAYER_KERNELS = ("qkv + input norm", "attention (+ q/k norm, RoPE, cache)", "o_proj + residual",
                 "gate_up + post norm + SiLU", "down + residual")
TAIL_LAYER_KERNELS = LAYER_KERNELS[:2] + ("o_proj + MLP (one launch)",)
ONE_TAIL_LAYER_KERNELS = (LAYER_KERNELS[1], "o_proj + MLP + next qkv (one launch)")


def step_increments(trace: Path, replays: int) -> dict[str, tuple[float, float]]:
    """From a profiler trace of back-to-back step-graph replays: for each kernel of a decode layer, how much
    later the step ends because of it (its end minus the latest end before it), median over layers and
    summed; plus everything outside the layers (LM head, sampler, input metadata). With PDL a kernel starts
    while the previous one drains, so durations overlap and only these increments add up to the step."""
    events = [e for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    events.sort(key=lambda e: e["ts"])
    per_replay = len(events) // replays
    replay = events[per_replay: 2 * per_replay]  # the second replay: the first may include warm-up effects
    span = max(e["ts"] + e["dur"] for e in replay) - replay[0]["ts"]
    period = events[2 * per_replay]["ts"] - replay[0]["ts"] if len(events) > 2 * per_replay else float("nan")
    print(f"replay: {per_replay} kernels, first start to last end {span:.1f} us, start to next start "
          f"{period:.1f} us")
    added, last_end = [], replay[0]["ts"]
    for e in replay:
        end = e["ts"] + e["dur"]
        added.append((e["name"], max(end - last_end, 0.0)))
        last_end = max(last_end, end)
    whole = [us for name, us in added if "decode_layers" in name]
    if whole:  # every layer in one launch (decode_layers.py): the launch, and each kernel around it
        out = {"all layers (one launch)": (whole[0], whole[0])}
        for name, us in added:
            if "decode_layers" not in name:
                label = name.removeprefix("_")[:34]
                out[label] = (out.get(label, (0.0, 0.0))[0] + us,) * 2
        rest = sum(us for name, us in added if "decode_layers" not in name)
        out["outside layers (LM head, sampler, inputs)"] = (rest, rest)
        return out
    attention = [i for i, (name, _) in enumerate(added) if "decode_split" in name]
    labels = {len(names): names for names in (LAYER_KERNELS, TAIL_LAYER_KERNELS, ONE_TAIL_LAYER_KERNELS)}
    if len(attention) < 2 or attention[1] - attention[0] not in labels:
        return {}
    names = labels[attention[1] - attention[0]]
    first, layers = attention[0] - names.index(LAYER_KERNELS[1]), len(attention)
    out = {}
    for offset, label in enumerate(names):
        values = sorted(added[first + layer * len(names) + offset][1] for layer in range(layers))
        out[label] = (values[len(values) // 2], sum(values))
    inside = range(first, first + layers * len(names))
    rest = sum(us for i, (_, us) in enumerate(added) if i not in inside)
    out["outside layers (LM head, sampler, inputs)"] = (rest, rest)
    return out


def check(model: Qwen3Model, base: Config, out: dict) -> None:
    """Greedy outputs: eager vs step (bit-identical at 1 request), model mode, async, torch vs triton."""
    prompts = [[(31 * p + 7 * j) % 5000 + 3 for j in range(24 + 8 * p)] for p in range(4)]
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    results = {}
    for name, changes in {
        "eager": dict(graph="eager"),
        "step": dict(graph="step"),
        "model": dict(graph="model"),
        "step-async": dict(graph="step", async_scheduling=True),
        "eager-torch": dict(graph="eager", kernels="torch"),
    }.items():
        engine = engine_for(model, base, **changes)
        results[name] = [engine.generate([p], params)[0] for p in prompts]  # one request at a time
        results[name + "-batch4"] = engine.generate(prompts, params)
        print(f"check {name}: replays={engine.stats.graph_replays} captures={engine.stats.graph_captures}")
        del engine
    ref = results["eager"]
    summary = {}
    for name, outputs in results.items():
        same = sum(a == b for x, y in zip(outputs, ref, strict=True) for a, b in zip(x, y, strict=True))
        summary[name] = f"{same}/{sum(len(x) for x in ref)} tokens equal to eager at 1 request"
        print(f"  {name:18s} {summary[name]}")
    out["check"] = summary


def hf_baseline(base: Config, steps: int, prompt_len: int) -> dict:
    """transformers Qwen3, random weights, batch 1: eager (dynamic cache) and static cache + CUDA graph."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, StaticCache

    hf_cfg = Qwen3Config(
        hidden_size=base.hidden_size,
        num_hidden_layers=base.num_layers,
        num_attention_heads=base.num_heads,
        num_key_value_heads=base.num_kv_heads,
        head_dim=base.head_dim,
        intermediate_size=base.intermediate_size,
        vocab_size=base.vocab_size,
        tie_word_embeddings=base.tie_embeddings,
        rope_theta=base.rope_theta,
        max_position_embeddings=4096,
    )
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    ids = torch.randint(3, 1000, (1, prompt_len), device="cuda")
    result = {}
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(3):
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            out = model(token, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
        sync()
        result["hf_eager_ms"] = (time.perf_counter() - start) / steps * 1e3
        try:
            result["hf_graph_ms"] = _hf_graph(model, hf_cfg, StaticCache, ids, steps)
        except Exception as exc:  # report, do not hide: the number is then missing
            result["hf_graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
    del model
    torch.cuda.empty_cache()
    return result


def _hf_graph(model, hf_cfg, static_cache_cls, ids, steps: int) -> float:
    length = ids.shape[1]
    try:
        cache = static_cache_cls(config=hf_cfg, max_cache_len=length + 2 * steps + 16)
    except TypeError:
        cache = static_cache_cls(
            config=hf_cfg,
            max_batch_size=1,
            max_cache_len=length + 2 * steps + 16,
            device="cuda",
            dtype=torch.bfloat16,
        )
    out = model(
        ids, past_key_values=cache, use_cache=True, cache_position=torch.arange(length, device="cuda")
    )
    token = out.logits[:, -1:].argmax(-1)
    position = torch.tensor([length], device="cuda")

    def decode():
        logits = model(
            token, past_key_values=cache, use_cache=True, cache_position=position, position_ids=position[None]
        ).logits
        token.copy_(logits[:, -1:].argmax(-1))
        position.add_(1)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            decode()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode()
    graph.replay()
    sync()
    start = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    sync()
    return (time.perf_counter() - start) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", default="qwen3-4b")
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--modes", default="eager,model,step,step-async", help="graph modes; -async: overlap")
    parser.add_argument("--kernels", default="torch,triton")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--check", action="store_true", help="compare greedy outputs across modes first")
    parser.add_argument("--no-bench", action="store_true")
    parser.add_argument("--profile", action="store_true", help="kernel table of the batch-1 step graph")
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--gemm-variant", default="default",
                        help=f"decode GEMM experiments, comma-separated, each benchmarked in turn (Triton "
                             f"kernels): {', '.join(sorted(GEMM_VARIANTS))}")
    parser.add_argument("--gemm-tiles", type=Path, help="tiles from a skinny_gemm_sweep.py --json run")
    args = parser.parse_args()
    variants = args.gemm_variant.split(",")
    unknown = [v for v in variants if v not in GEMM_VARIANTS]
    if unknown:
        choices = ", ".join(sorted(GEMM_VARIANTS))
        parser.error(f"unknown --gemm-variant {', '.join(unknown)}: choose from {choices}")
    tiles = gemm_tiles(args.gemm_tiles) if args.gemm_tiles else None
    first_changes = apply_gemm_variant(variants[0], tiles)
    base = Config(preset=args.preset, max_model_len=args.max_model_len, **first_changes)
    cuda = base.device == "cuda"
    out = {
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    t0 = time.perf_counter()
    model = Qwen3Model.random(base)
    sync()
    weight_bytes = model.weight_bytes_per_step()
    bandwidth = copy_bandwidth(base.device)
    out.update(
        weights_gb=weight_bytes / 1e9,
        copy_tb_s=bandwidth / 1e12,
        floor_ms=weight_bytes / bandwidth * 1e3,
        lm_head_share=model.lm_head.numel() * model.lm_head.element_size() / weight_bytes,
    )
    print(
        f"model built in {time.perf_counter() - t0:.1f}s; weights {out['weights_gb']:.2f} GB, "
        f"copy {out['copy_tb_s']:.2f} TB/s, floor {out['floor_ms']:.3f} ms, "
        f"lm_head {out['lm_head_share']:.0%}"
    )
    if args.check and cuda:
        check(model, base, out)
    if args.profile and cuda:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        out["breakdown"] = breakdown(model, base, kernels=args.kernels.split(",")[-1],
                                     trace=Path(args.out) / "step_trace.json")
    rows = []
    if not args.no_bench:
        for variant, kernels, mode in itertools.product(variants, args.kernels.split(","),
                                                        args.modes.split(",")):
            changes = apply_gemm_variant(variant, tiles)
            graph, _, overlap = mode.partition("-")
            label = mode if variant == "default" else f"{mode}/{variant}"
            engine = engine_for(model, base, graph=graph, kernels=kernels, async_scheduling=bool(overlap),
                                **changes)
            for batch in map(int, args.batches.split(",")):
                r = time_decode(engine, batch, args.steps, args.prompt_len)
                rows.append(dict(kernels=kernels, graph=label, batch=batch, **r))
                print(f"{kernels:6s} {label} b={batch}: {r['step_ms']:.3f} ms/step (gpu {r['gpu_ms']:.3f})")
            del engine
            torch.cuda.empty_cache() if cuda else None
    out["rows"] = rows
    if cuda and not args.no_hf:
        del model
        torch.cuda.empty_cache()
        out.update(hf_baseline(base, args.steps, args.prompt_len))
    Path(args.out).mkdir(parents=True, exist_ok=True)
    tag = "-".join(args.kernels.split(","))
    (Path(args.out) / f"results-{tag}.json").write_text(json.dumps(out, indent=2))
    print_table(out)


def print_table(out: dict) -> None:
    floor, hf = out["floor_ms"], out.get("hf_graph_ms")
    print(
        f"\n{out['preset']} on {out['device']} ({out['date']}): floor {floor:.3f} ms "
        f"({out['weights_gb']:.2f} GB at {out['copy_tb_s']:.2f} TB/s); transformers b=1 eager "
        f"{out.get('hf_eager_ms', float('nan')):.2f} ms, static+graph {hf or float('nan'):.2f} ms "
        f"{out.get('hf_graph_error', '')}"
    )
    print(
        f"{'kernels':7s} {'graph':26s} {'batch':>5s} {'ms/step':>8s} {'gpu ms':>7s} "
        f"{'x floor':>7s} {'HF/this':>7s}"
    )
    for r in out["rows"]:
        speedup = hf / r["step_ms"] if hf else float("nan")
        print(
            f"{r['kernels']:7s} {r['graph']:26s} {r['batch']:5d} {r['step_ms']:8.3f} {r['gpu_ms']:7.3f} "
            f"{r['step_ms'] / floor:7.2f} {speedup:7.2f}"
        )


if __name__ == "__main__":
    main()
