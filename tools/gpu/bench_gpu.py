"""GPU benchmark: a random bf16 checkpoint with Llama-3.2-1B's shapes through our engine and transformers, beside the memory floor.

One run, one process, one model (tools/make_tiny_model.py --preset 1b: 16 layers, hidden 2048,
32/8 heads of 64, MLP 8192, vocab 128256, tied embeddings; weights drawn on the GPU, saved with
safetensors, reused from --model-dir when it already holds them). Sections, in this order:

- floor: HBM bandwidth measured by device-to-device copies of a 1 GiB buffer (bytes read plus
  bytes written over CUDA-event time, the median of 10); weight bytes / bandwidth is the least
  time a decode step can take, since every step reads every weight once.
- ours: the offline engine (pipeline.LLM, driven step by step through its Engine) with async and
  sync scheduling, CUDA graphs on and off (EngineConfig.enforce_eager), at batch 1, 32 and 256.
- transformers: the same prompts through `generate` (one static batch) and, where the installed
  version has it, its continuous batching (`generate_batch`); an absent or failing API is a note
  in the output, not an error.
- busy: torch.profiler over 50 steady decode steps of ours (async, graphs on) at batch 1 and 64:
  the GPU's busy share (the union of kernel and copy intervals over the span of the window's device
  events, and over its wall time), kernels per step and where the device waited (gpu_profile.py).

Workload: every batch row gets a 512-token prompt and generates 256 tokens, greedy, EOS ignored.
Prompts are token ids drawn uniformly in [2, tokenizer size): the random model's tokenizer (trained
on a small embedded corpus) has far fewer entries than its 128256-row vocabulary, and ids below
its size keep the engine's detokenizer on real tokens. No tokenizer is used to make prompts.

TPOT is the median wall time of one step of steady decode: the time between consecutive returns
of Engine.step() from the step after every request has its first token until the first request
finishes, so prefill is excluded. In async mode a step returns the previous step's tokens while
the next one runs, so this is the period at which tokens arrive. Output tok/s counts every output
token over the whole run of the batch, prefill included; decode tok/s is batch / TPOT.
transformers' TPOT is (time for 256 tokens - time for 1 token) / 255 at the same batch.

`--quick` runs the same plumbing on a small float32 model on the CPU (short prompts, batches 1
and 4, 5 profiled steps at each): it proves the script, not a speed. `--json` prints one JSON object; the
table goes to stderr. `--out FILE` rewrites FILE with the results so far after every section, so
a run stopped by a time limit still leaves what it measured.

    python tools/gpu/bench_gpu.py [--json] [--quick] [--model-dir DIR] [--out FILE]
        [--sections floor,ours,busy,transformers] [--batches 1,32,256] [--busy-batches 1,64]
        [--configs async-graphs,async-eager,sync-graphs,sync-eager] [--trace FILE.json.gz]
"""
from __future__ import annotations

import argparse
import gzip
import json
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_profile import summarize_profile
from gpu_reference import (BLOCK_SIZE, FULL, MAX_BATCH_TOKENS, QUICK, Setup, hf_continuous_batching, hf_generate,
                           hf_version, load_hf, measure_bandwidth, random_prompts, release)

from pipeline import LLM, SamplingParams
from pipeline.models.tiny_model import make_tiny_model

SECTIONS = ("floor", "ours", "busy", "transformers")
CONFIGS = ("async-graphs", "async-eager", "sync-graphs", "sync-eager")  # scheduling-graphs of ours


@dataclass(slots=True)
class OursRun:
    """One batch through our engine."""

    scheduling: str  # async | sync
    graphs: bool  # EngineConfig.enforce_eager is its negation
    batch: int
    tpot_ms: float  # median step time in steady decode
    step_p90_ms: float
    num_steady_steps: int
    decode_tok_s: float  # batch / TPOT
    output_tok_s: float  # every output token over the whole run, prefill included
    elapsed_s: float


# ---- the model and the workload


def ensure_model(model_dir: Path, setup: Setup) -> tuple[Path, float]:
    """The checkpoint in model_dir, built there unless it already holds one; (path, seconds spent)."""
    if (model_dir / "config.json").is_file() and any(model_dir.glob("*.safetensors")):
        return model_dir, 0.0
    start_s = time.perf_counter()
    make_tiny_model(model_dir, "llama", seed=0, preset=setup.preset, dtype=setup.dtype, device=setup.device,
                    **setup.model_sizes)
    return model_dir, time.perf_counter() - start_s


def model_facts(model_dir: Path) -> dict[str, Any]:
    """Parameters, weight bytes, vocabulary and tokenizer size, read from the files."""
    from safetensors import safe_open
    from tokenizers import Tokenizer

    num_params = weight_bytes = 0
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                tensor = f.get_slice(name)
                count = int(np.prod(tensor.get_shape()))
                num_params += count
                weight_bytes += count * torch.empty((), dtype=getattr(torch, _torch_dtype(tensor.get_dtype()))).element_size()
    config = json.loads((model_dir / "config.json").read_text())
    tokenizer_size = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
    return {"num_params": num_params, "weight_bytes": weight_bytes, "vocab_size": int(config["vocab_size"]),
            "tokenizer_size": tokenizer_size, "num_layers": int(config["num_hidden_layers"]),
            "hidden_size": int(config["hidden_size"]), "tie_word_embeddings": bool(config["tie_word_embeddings"])}


def _torch_dtype(safetensors_dtype: str) -> str:
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    if safetensors_dtype not in names:
        raise ValueError(f"unexpected weight dtype {safetensors_dtype!r} in the checkpoint")
    return names[safetensors_dtype]


# ---- our engine


def make_llm(model_dir: Path, setup: Setup, *, async_scheduling: bool, graphs: bool) -> LLM:
    max_batch = max(setup.batches + setup.busy_batches)
    max_model_len = setup.prompt_len + setup.output_len + BLOCK_SIZE
    return LLM(model=model_dir, device=setup.device, dtype=setup.dtype, async_scheduling=async_scheduling,
               enforce_eager=not graphs, max_num_seqs=max_batch, max_model_len=max_model_len,
               max_num_batched_tokens=MAX_BATCH_TOKENS,
               num_kv_blocks=max_batch * -(-max_model_len // BLOCK_SIZE) + max_batch, block_size=BLOCK_SIZE,
               enable_prefix_caching=False)


class StepClock:
    """Drives an engine to completion and notes when each step returned and what it delivered."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.next_req_id = 10**6  # clear of the ids LLM.generate hands out

    def add(self, prompts: Sequence[Sequence[int]], output_len: int) -> list[int]:
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        req_ids = []
        for prompt in prompts:
            self.engine.add_request(self.next_req_id, list(prompt), params)
            req_ids.append(self.next_req_id)
            self.next_req_id += 1
        return req_ids

    def run(self, req_ids: list[int], on_step: Callable[[int, int | None], None] | None = None) -> dict[str, Any]:
        """Steps until idle, calling on_step(step, the step at which every request had a token or
        None) after each. Returns step end times, the step at which every request had a token,
        the step at which the first finished, and the tokens each request got."""
        tokens = {req_id: 0 for req_id in req_ids}
        step_ends: list[float] = []
        all_started = first_finished = None
        start_s = time.perf_counter()
        while self.engine.busy:
            events = self.engine.step()
            step_ends.append(time.perf_counter())
            step = len(step_ends) - 1
            for event in events:
                if event.error_code is not None:
                    raise RuntimeError(f"request {event.req_id} failed: {event.error_code} {event.error_message}")
                tokens[event.req_id] += len(event.token_ids)
                if event.finish_reason is not None and first_finished is None:
                    first_finished = step
            if all_started is None and all(tokens.values()):
                all_started = step
            if on_step is not None:
                on_step(step, all_started)
        return {"start_s": start_s, "step_ends": step_ends, "all_started": all_started,
                "first_finished": first_finished, "tokens": tokens}


def steady_step_times(record: dict[str, Any]) -> list[float]:
    """Seconds between consecutive step returns in steady decode (see the module's docstring)."""
    ends, first, last = record["step_ends"], record["all_started"], record["first_finished"]
    if first is None or last is None:
        return []
    return [b - a for a, b in zip(ends[first:last], ends[first + 1:last + 1])]


def run_ours(llm: LLM, setup: Setup, batch: int, tokenizer_size: int, scheduling: str, graphs: bool) -> OursRun:
    clock = StepClock(llm)
    # Warm-up prompts as long as the measured ones, so what a first prefill of that length costs
    # once (Triton compiles a kernel per new specialisation of its integer arguments) stays out of
    # the measured run: with 16-token warm-ups, the first configuration's runs on an H200 spent
    # 0.45-1.4 s outside steady decode, the other configurations' 0.1 s.
    warmup = random_prompts(batch, setup.prompt_len, tokenizer_size, seed=batch + 1)
    clock.run(clock.add(warmup, setup.warmup_tokens))
    req_ids = clock.add(random_prompts(batch, setup.prompt_len, tokenizer_size, seed=batch), setup.output_len)
    record = clock.run(req_ids)
    if any(n != setup.output_len for n in record["tokens"].values()):
        raise RuntimeError(f"batch {batch}: a request got other than {setup.output_len} tokens: {record['tokens']}")
    steps = steady_step_times(record)
    if not steps:
        raise RuntimeError(f"batch {batch}: no steady decode steps (output_len {setup.output_len} too short?)")
    tpot_s = statistics.median(steps)
    elapsed_s = record["step_ends"][-1] - record["start_s"]
    return OursRun(scheduling=scheduling, graphs=graphs, batch=batch, tpot_ms=tpot_s * 1e3,
                   step_p90_ms=float(np.percentile(steps, 90)) * 1e3, num_steady_steps=len(steps),
                   decode_tok_s=batch / tpot_s, output_tok_s=batch * setup.output_len / elapsed_s,
                   elapsed_s=elapsed_s)


def measure_busy(llm: LLM, setup: Setup, tokenizer_size: int, batch: int, trace: Path | None = None) -> dict[str, Any]:
    """torch.profiler over `profile_steps` steady decode steps at `batch`; the events as a gzipped
    Chrome trace in `trace` when given."""
    from torch.profiler import ProfilerActivity, profile

    clock = StepClock(llm)
    warm_steps = 2  # after every request has its first token
    output_len = warm_steps + setup.profile_steps + 16  # a margin, so the profiled steps are all decode
    req_ids = clock.add(random_prompts(batch, setup.prompt_len, tokenizer_size, seed=7), output_len)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if setup.device == "cuda" else [])
    window: dict[str, Any] = {}
    profiler = profile(activities=activities)

    def on_step(step: int, all_started: int | None) -> None:
        if all_started is None:
            return
        if step == all_started + warm_steps:
            if setup.device == "cuda":
                torch.cuda.synchronize()
            profiler.start()
            window["start_s"] = time.perf_counter()
        elif step == all_started + warm_steps + setup.profile_steps:
            if setup.device == "cuda":
                torch.cuda.synchronize()
            window["wall_s"] = time.perf_counter() - window["start_s"]
            profiler.stop()

    clock.run(req_ids, on_step)
    if "wall_s" not in window:
        raise RuntimeError("the profiled window did not complete")
    if trace is not None:
        with tempfile.TemporaryDirectory() as scratch:
            plain = Path(scratch) / "trace.json"
            profiler.export_chrome_trace(str(plain))
            with plain.open("rb") as source, gzip.open(trace, "wb") as target:
                shutil.copyfileobj(source, target)
    return summarize_profile(profiler.events(), window["wall_s"], setup.profile_steps, setup.device, batch)


# ---- the run


class Report:
    """The results so far; rewritten to --out after every section."""

    def __init__(self, out: Path | None) -> None:
        self.data: dict[str, Any] = {"notes": []}
        self.out = out

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()

    def note(self, text: str) -> None:
        self.data["notes"].append(text)
        self.save()

    def save(self) -> None:
        if self.out is not None:
            self.out.write_text(json.dumps(self.data, indent=1))


def device_facts(device: str) -> dict[str, Any]:
    facts: dict[str, Any] = {"device": device, "torch": torch.__version__}
    if device == "cuda":
        facts.update(name=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                     cudnn=torch.backends.cudnn.version(),
                     memory_gib=round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    return facts


def run_sections(setup: Setup, model_dir: Path, sections: Sequence[str], report: Report,
                 configs: Sequence[str] = CONFIGS, trace: Path | None = None) -> None:
    report.set("setup", {"device": setup.device, "dtype": setup.dtype, "preset": setup.preset,
                         "prompt_len": setup.prompt_len, "output_len": setup.output_len,
                         "batches": list(setup.batches), "busy_batches": list(setup.busy_batches),
                         "sections": list(sections), "configs": list(configs)})
    report.set("device", device_facts(setup.device))
    model_dir, build_s = ensure_model(model_dir, setup)
    facts = model_facts(model_dir)
    report.set("model", {**facts, "dir": str(model_dir), "build_s": build_s})
    tokenizer_size = facts["tokenizer_size"]
    runs = {"floor": lambda: run_floor(setup, facts, report),
            "ours": lambda: run_ours_configs(model_dir, setup, tokenizer_size, configs, report),
            "busy": lambda: run_busy(model_dir, setup, tokenizer_size, report, trace),
            "transformers": lambda: run_transformers(model_dir, setup, tokenizer_size, report)}
    for section in sections:  # in the order given; a section that fails is a note, and the next runs
        try:
            runs[section]()
        except Exception as error:
            traceback.print_exc()
            report.note(f"section {section} failed: {type(error).__name__}: {error}")


def run_floor(setup: Setup, facts: dict[str, Any], report: Report) -> None:
    floor = measure_bandwidth(setup.device)
    floor["weight_floor_ms"] = facts["weight_bytes"] / (floor["bandwidth_gb_s"] * 1e9) * 1e3
    report.set("floor", floor)


def run_ours_configs(model_dir: Path, setup: Setup, tokenizer_size: int, configs: Sequence[str],
                     report: Report) -> None:
    runs: list[dict[str, Any]] = []
    for config in configs:
        scheduling, graphs = config.split("-")[0], config.endswith("-graphs")
        try:
            llm = make_llm(model_dir, setup, async_scheduling=scheduling == "async", graphs=graphs)
            for batch in setup.batches:
                runs.append(asdict(run_ours(llm, setup, batch, tokenizer_size, scheduling, graphs)))
                report.set("ours", runs)
            release(llm)
        except Exception as error:  # the other configurations still run
            traceback.print_exc()
            report.note(f"ours {config} failed: {type(error).__name__}: {error}")


def run_busy(model_dir: Path, setup: Setup, tokenizer_size: int, report: Report, trace: Path | None) -> None:
    llm = make_llm(model_dir, setup, async_scheduling=True, graphs=True)
    busy: list[dict[str, Any]] = []
    for batch in setup.busy_batches:
        last = batch == setup.busy_batches[-1]
        busy.append(measure_busy(llm, setup, tokenizer_size, batch, trace if last else None))
        report.set("busy", busy)
    release(llm)


def run_transformers(model_dir: Path, setup: Setup, tokenizer_size: int, report: Report) -> None:
    try:
        model = load_hf(model_dir, setup)
    except Exception as error:  # an optional comparison: say why and go on
        report.note(f"transformers skipped: the model did not load ({type(error).__name__}: {error})")
        return
    report.set("transformers_version", hf_version())
    generate_runs: list[dict[str, Any]] = []
    for batch in setup.batches:
        generate_runs.append(asdict(hf_generate(model, setup, batch, tokenizer_size)))
        report.set("transformers_generate", generate_runs)
    cb_runs: list[dict[str, Any]] = []
    for batch in setup.batches:
        try:
            cb_runs.append(asdict(hf_continuous_batching(model, setup, batch, tokenizer_size)))
        except Exception as error:  # absent in old versions, unsupported on some devices
            report.note(f"transformers continuous batching unavailable at batch {batch}: "
                        f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
            break
        report.set("transformers_continuous_batching", cb_runs)
    release(model)


def format_table(data: dict[str, Any]) -> str:
    lines = []
    model, setup = data.get("model", {}), data.get("setup", {})
    dev = data.get("device", {})
    lines.append(f"{dev.get('name', dev.get('device', '?'))}, torch {dev.get('torch', '?')}; "
                 f"model {model.get('num_params', 0) / 1e9:.2f}B params {setup.get('dtype', '?')} "
                 f"({model.get('weight_bytes', 0) / 1e9:.2f} GB), prompt {setup.get('prompt_len')} output "
                 f"{setup.get('output_len')} tokens, greedy")
    if "floor" in data:
        floor = data["floor"]
        lines.append(f"floor: {floor['method']} {floor['bandwidth_gb_s']:.0f} GB/s -> weights read once per step "
                     f"= {floor['weight_floor_ms']:.3f} ms")
    rows = [(f"ours {r['scheduling']} graphs {'on' if r['graphs'] else 'off'}", r) for r in data.get("ours", [])]
    rows += [("transformers generate", r) for r in data.get("transformers_generate", [])]
    rows += [("transformers cont. batching", r) for r in data.get("transformers_continuous_batching", [])]
    if rows:
        floor_ms = data.get("floor", {}).get("weight_floor_ms")
        lines.append(f"{'path':<30}{'batch':>6}{'TPOT ms':>10}{'x floor':>9}{'output tok/s':>14}{'time s':>9}")
        for name, r in rows:
            tpot = r.get("tpot_ms")
            ratio = f"{tpot / floor_ms:>9.2f}" if tpot is not None and floor_ms else f"{'-':>9}"
            tpot_text = f"{tpot:>10.3f}" if tpot is not None else f"{'-':>10}"
            lines.append(f"{name:<30}{r['batch']:>6}{tpot_text}{ratio}{r['output_tok_s']:>14.1f}{r['elapsed_s']:>9.2f}")
    for busy in data.get("busy", []):
        share = "-" if busy["busy_share"] is None else f"{100 * busy['busy_share']:.1f}%"
        per_step = busy["kernels_per_step"] if busy["kernels_per_step"] is not None else busy.get("aten_ops_per_step")
        unit = "kernels" if busy["kernels_per_step"] is not None else "aten ops"
        lines.append(f"steady decode, batch {busy['batch']}, {busy['steps']} steps: GPU busy {share}, {per_step:.0f} "
                     f"{unit} per step, {busy['wall_ms_per_step']:.3f} ms per step")
        if busy.get("busy_share") is not None:
            lines.append(f"  idle per step: {busy['short_gaps_ms_per_step']:.3f} ms between launches, "
                         f"{busy['long_gaps_ms_per_step']:.3f} ms waiting for the host; busy over the window's "
                         f"wall time {100 * busy['busy_share_wall']:.1f}%")
            for wait in busy["longest_waits"]:
                lines.append(f"  waits {wait['ms_per_step']:.3f} ms per step after {wait['after']} for {wait['before']}")
    lines += [f"note: {note}" for note in data.get("notes", [])]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout (the table goes to stderr)")
    parser.add_argument("--quick", action="store_true", help="a small float32 model on the CPU: the plumbing only")
    parser.add_argument("--model-dir", type=Path, default=None,
                        help="where the checkpoint is cached: reused when it holds one, else built there "
                             "(default: a temporary directory)")
    parser.add_argument("--out", type=Path, default=None, help="rewrite this JSON file after every section")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated, of " + ",".join(SECTIONS))
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,32,256; quick 1,4)")
    parser.add_argument("--busy-batches", default=None,
                        help="comma-separated batch sizes the profiler watches (default 1,64; quick 1,4)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="write the profile of the last busy batch here as a gzipped Chrome trace")
    parser.add_argument("--configs", default=",".join(CONFIGS),
                        help="comma-separated runs of ours, of " + ",".join(CONFIGS))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"--sections: unknown {unknown}; known: {list(SECTIONS)}")
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {list(CONFIGS)}")
    setup = QUICK if args.quick else FULL
    for option in ("batches", "busy_batches"):
        text = getattr(args, option)
        if text is None:
            continue
        flag = "--" + option.replace("_", "-")
        try:
            batches = tuple(int(b) for b in text.split(","))
        except ValueError:
            parser.error(f"{flag} must be comma-separated integers, got {text!r}")
        if not batches or min(batches) < 1:
            parser.error(f"{flag} must be positive, got {text!r}")
        setup = Setup(**{**asdict(setup), option: batches})
    if setup.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device (torch.cuda.is_available() is False); --quick runs on the CPU", file=sys.stderr)
        return 2
    report = Report(args.out)
    with tempfile.TemporaryDirectory(prefix="pl-bench-gpu-") as scratch:
        run_sections(setup, args.model_dir or Path(scratch) / f"llama-{setup.preset}", sections, report, configs, args.trace)
    table = format_table(report.data)
    if args.json:
        print(table, file=sys.stderr)
        print(json.dumps(report.data))
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
