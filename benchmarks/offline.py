"""Offline throughput: N Azure-conversation requests through `LLMEngine.generate`, and vLLM's `LLM.generate`.

Both systems get the same token-id prompts (lengths from the Azure LLM inference 2023 conversation trace,
ids drawn with a fixed seed), the same max_tokens per request with ignore_eos, greedy sampling, dummy
weights, and run one after the other on the same machine (vLLM in a child process, after our engine has
released the GPU). Reported: requests/s, output tokens/s and total tokens/s over the timed `generate`
call (a short warm-up call runs before it), as JSON.

    python -m benchmarks.offline --device cpu --model dummy:tiny-llama --num-prompts 32 --max-total-tokens 256
    python -m benchmarks.offline --device cuda --num-prompts 1000 --vllm --out /tmp/out/offline.json   # GPU

vLLM runs with its defaults except prefix caching off (ours has none), on benchmarks.gpu.vllm_model's folder
(our preset's config and a word-level tokenizer, so both systems produce text for every token); its packages
come first on the child's path from $VLLM_SITE (default /tmp/vsite, see benchmarks/gpu/run_serve_h100.sh):

    bash benchmarks/gpu/run_serve_h100.sh py benchmarks.offline --vllm --trace-path /tmp/azure --out $OUT/offline.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.traces import RequestSpec, WorkloadConfig, build_workload, default_trace_dir

logger = logging.getLogger("offline")


def workload(args: argparse.Namespace, vocab_size: int) -> list[RequestSpec]:
    cfg = WorkloadConfig(dataset="azure-conv", num_prompts=args.num_prompts, seed=args.seed,
                         trace_path=args.trace_path, max_total_tokens=args.max_total_tokens,
                         vocab_low=min(1000, vocab_size // 4), vocab_high=min(30000, vocab_size))
    return build_workload(cfg)


def _token_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token counts like 2048 or 2048,16384; got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"token counts must be >= 0 (0: no piecewise graphs); got {text!r}")
    return values


def _names_of(modes: tuple[str, ...], text: str) -> list[str]:
    names = [t for t in text.split(",") if t]
    unknown = [n for n in names if n not in modes]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"expected {' or '.join(modes)} (a comma list runs each); got {text!r}")
    return names


def _attention_list(text: str) -> list[str]:
    from bullet_ray.config import PREFILL_ATTENTION_MODES

    return _names_of(PREFILL_ATTENTION_MODES, text)


def _init_list(text: str) -> list[str]:
    from bullet_ray.models.loader import DUMMY_INITS

    return _names_of(DUMMY_INITS, text)


# the engine's environment switches, recorded with each of our runs: the GPU attention backend's
# (bullet_ray.engine.attention.flashinfer_backend) and how dummy weights are drawn (bullet_ray.models.loader)
ENGINE_SWITCHES = ("BULLET_RAY_PREFILL_ATTENTION", "BULLET_RAY_KV_WRITE", "BULLET_RAY_MIXED_ATTENTION",
                   "BULLET_RAY_DUMMY_INIT", "BULLET_RAY_DECODE_PLAN")
# the benchmarks' names for the switches' other settings (serve_h100's environment suffixes, kernel_compare's variants)
ENGINE_VARIANTS: dict[str, dict[str, str]] = {
    "attnoverlap": {"BULLET_RAY_MIXED_ATTENTION": "overlap"},  # a mixed step's two kernels on two streams
    "attnholistic": {"BULLET_RAY_MIXED_ATTENTION": "holistic"},  # every row of a mixed step in one kernel
    "ragged": {"BULLET_RAY_PREFILL_ATTENTION": "ragged"},  # prompts that start in a step through the ragged prefill
    "paged": {"BULLET_RAY_PREFILL_ATTENTION": "paged"},  # every prompt row through the paged prefill, as before m17
    "scatter": {"BULLET_RAY_KV_WRITE": "scatter"},  # the K/V write by index_put_, as before the paged append
    "vllminit": {"BULLET_RAY_DUMMY_INIT": "uniform"},  # dummy weights drawn as vLLM's dummy loader draws them
    "directplan": {"BULLET_RAY_DECODE_PLAN": "direct"},  # decode graphs planned by flashinfer's planner directly
}


def engine_switches() -> dict[str, str]:
    """The environment switches a run's engine is built under ("default": unset, the engine's own)."""
    return {k: os.environ.get(k, "default") for k in ENGINE_SWITCHES}


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set for the block (a worker built inside reads them), as it was after."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _gemm_list(text: str) -> list[str]:
    from bullet_ray.config import PREFILL_GEMMS

    names = [t for t in text.split(",") if t]
    unknown = [n for n in names if n not in PREFILL_GEMMS]
    if not names or unknown:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(PREFILL_GEMMS)} (got {text!r})")
    return names


def _plan_lead(text: str) -> float | None:
    """--prefill-plan-lead-ms: milliseconds >= 0, or none (plan at once)."""
    if text == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds >= 0 or none; got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected milliseconds >= 0 or none; got {text!r}")
    return value


def _suffixed(path: str | None, suffix: str) -> str | None:
    """`steps.jsonl` -> `steps-<suffix>.jsonl`, `steps.jsonl.gz` -> `steps-<suffix>.jsonl.gz` (a variant's
    step log beside the first run's)."""
    if path is None:
        return None
    p = Path(path)
    stem, dot, exts = p.name.partition(".")
    return str(p.with_name(f"{stem}-{suffix}{dot}{exts}"))


def summary(specs: list[RequestSpec], outputs_tokens: list[int], seconds: float) -> dict[str, Any]:
    num_prompt = sum(s.prompt_tokens for s in specs)
    num_out = sum(outputs_tokens)
    return {"num_requests": len(specs), "seconds": round(seconds, 3),
            "requests_per_s": round(len(specs) / seconds, 3), "output_tokens_per_s": round(num_out / seconds, 1),
            "total_tokens_per_s": round((num_prompt + num_out) / seconds, 1), "prompt_tokens": num_prompt,
            "output_tokens": num_out, "output_tokens_expected": sum(s.output_tokens for s in specs)}


def engine_config(args: argparse.Namespace) -> Any:
    """Our engine's EngineConfig from this command line (benchmarks.gpu.kernel_compare reuses it)."""
    from bullet_ray.config import EngineConfig

    return EngineConfig(model=args.model, device=args.device, schedule=args.schedule,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        kv_cache_memory_gb=args.kv_cache_gb, max_model_len=args.max_total_tokens,
                        async_scheduling=None if args.async_scheduling == "auto" else args.async_scheduling == "on",
                        enforce_eager=args.enforce_eager, step_log_path=args.step_log,
                        profile_dir=args.profile_dir, profile_start_step=args.profile_start_step,
                        profile_num_steps=args.profile_num_steps,
                        piecewise_graph_tokens=args.piecewise_graph_tokens[0] if args.piecewise_graph_tokens else None,
                        piecewise_buckets=args.piecewise_buckets, prefill_gemm=args.prefill_gemm[0],
                        prefill_plan_lead_ms=args.prefill_plan_lead_ms)


def run_ours(args: argparse.Namespace) -> dict[str, Any]:
    from bullet_ray.engine.llm_engine import LLMEngine
    from bullet_ray.engine.sampling_params import SamplingParams

    config = engine_config(args)
    start = time.perf_counter()
    with LLMEngine(config) as engine:
        startup_s = time.perf_counter() - start
        specs = workload(args, engine.vocab_size)
        params = [SamplingParams(temperature=0.0, max_tokens=s.output_tokens, ignore_eos=True) for s in specs]
        prompts: list[Any] = [s.prompt for s in specs]
        if args.warmup > 0:
            engine.generate(prompts[:args.warmup], params[:args.warmup])
        start = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=True)
        seconds = time.perf_counter() - start
        info = engine.worker_info.get("decode" if config.is_disaggregated else "hybrid", {})
        graphs = info.get("graphs")
    result = summary(specs, [len(o.token_ids) for o in outs], seconds)
    # mixed_attention: how a mixed step's attention ran (BULLET_RAY_MIXED_ATTENTION, flashinfer only; the hybrid
    # worker's, or with the bullet schedule the decode worker's: both read the same environment)
    result.update(system=f"bullet_ray {args.schedule}", startup_s=round(startup_s, 1), decode_graphs=graphs,
                  mixed_attention=info.get("mixed_attention"), engine_switches=engine_switches(),
                  config={k: getattr(config, k) for k in ("schedule", "max_num_seqs", "max_num_batched_tokens",
                                                          "kv_cache_memory_gb", "is_async_scheduling", "enforce_eager",
                                                          "piecewise_graph_tokens")},
                  piecewise_limit=config.piecewise_limit("prefill" if config.is_disaggregated else "hybrid"))
    return result


def vllm_model_and_workload(args: argparse.Namespace) -> tuple[str, list[RequestSpec]]:
    """vLLM's model folder for the dummy preset `args.model` (our config, a word-level tokenizer) and the
    workload's requests drawn for its vocabulary (this offline run's and benchmarks.gpu.kernel_compare's)."""
    from benchmarks.gpu.vllm_model import PRESET, write_model_folder

    if not args.model.startswith("dummy:"):
        raise SystemExit(f"vLLM runs dummy weights only; got --model {args.model}")
    preset = PRESET.with_name(args.model.removeprefix("dummy:") + ".json")
    folder = write_model_folder(tempfile.mkdtemp(prefix="vllm_model_"), preset)
    return str(folder), workload(args, int(json.loads(preset.read_text())["vocab_size"]))


def run_vllm(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's offline LLM.generate on the same prompts (this process must not have touched the GPU)."""
    from vllm import LLM, SamplingParams, TokensPrompt  # type: ignore[import-not-found]

    folder, specs = vllm_model_and_workload(args)
    start = time.perf_counter()
    llm = LLM(model=folder, load_format="dummy", dtype="bfloat16", enable_prefix_caching=False,
              max_model_len=args.max_total_tokens, seed=args.seed)
    startup_s = time.perf_counter() - start
    prompts = [TokensPrompt(prompt_token_ids=list(s.prompt)) for s in specs]  # type: ignore[arg-type]
    params = [SamplingParams(temperature=0.0, max_tokens=s.output_tokens, ignore_eos=True) for s in specs]
    llm.generate(prompts[:args.warmup], params[:args.warmup], use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    seconds = time.perf_counter() - start
    import vllm  # type: ignore[import-not-found]

    result = summary(specs, [len(o.outputs[0].token_ids) for o in outs], seconds)
    config: dict[str, Any] = {"enable_prefix_caching": False, "max_model_len": args.max_total_tokens, "defaults": "else"}
    try:  # the limits vLLM resolved from its defaults, to set beside ours
        sched = llm.llm_engine.vllm_config.scheduler_config
        config.update(max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens)
        cache = llm.llm_engine.vllm_config.cache_config
        config.update(kv_cache_tokens=int(cache.num_gpu_blocks or 0) * int(cache.block_size))
    except AttributeError:
        pass
    result.update(system=f"vllm {vllm.__version__}", startup_s=round(startup_s, 1), config=config)
    return result


def build_parser() -> argparse.ArgumentParser:
    """The command line (benchmarks.gpu.kernel_compare reuses its defaults for our engine's set-up)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--schedule", default="chunked", choices=["chunked", "bullet", "static"])
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=8, help="requests of the untimed warm-up call")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace-path", default=str(default_trace_dir()))
    parser.add_argument("--max-total-tokens", type=int, default=16384, help="prompt + output cap (and max_model_len)")
    parser.add_argument("--max-num-seqs", type=int, default=1024,
                        help="ours (default: what vLLM 0.24's LLM resolves on an 80 GB H100)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384,
                        help="ours (default: what vLLM 0.24's LLM resolves on an 80 GB H100)")
    parser.add_argument("--kv-cache-gb", type=float, default=None,
                        help="GiB of KV cache, ours (default: 56 on GPU, vLLM 0.24's 457,504 tokens of Llama-3.1-8B "
                             "at 0.9 memory utilization on an 80 GB H100; 1 on CPU)")
    parser.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--step-log", default=None, help="JSONL step log of our workers (benchmarks/plot_steps.py)")
    parser.add_argument("--profile-dir", default=None,
                        help="profile a window of our workers' steps into this folder (host cProfile, torch.profiler)")
    parser.add_argument("--profile-start-step", type=int, default=200, help="first profiled step")
    parser.add_argument("--profile-num-steps", type=int, default=50, help="profiled steps")
    parser.add_argument("--piecewise-buckets", choices=("tuned", "fixed"), default="tuned",
                        help="piecewise graphs' token buckets above 512 tokens: tuned at start from the GPU's GEMM "
                             "times (the engine's default) or fixed (every 64 / 128 / 256)")
    parser.add_argument("--piecewise-graph-tokens", type=_token_list, default=None,
                        help="steps with prompt tokens up to this many run through piecewise CUDA graphs (default: "
                             "the engine's: the whole token budget on the chunked schedule, at most 2048 on bullet "
                             "or static); a comma list runs our engine "
                             "once per value, the first as 'ours', the others as 'ours_pw<N>' (e.g. 16384,2048)")
    parser.add_argument("--prefill-gemm", type=_gemm_list, default=["cublas"],
                        help="engine.prefill_gemm (cublas, cublaslt, cublaslt-all: the projections of steps with "
                             "prompt tokens through cuBLASLt algorithms tuned at start); a comma list runs our engine "
                             "once per value, the first as 'ours', the others as 'ours_<gemm>' (e.g. cublas,cublaslt)")
    parser.add_argument("--prefill-attention", type=_attention_list, default=None,
                        help="BULLET_RAY_PREFILL_ATTENTION for our engine (ragged, the engine's default: prompts that start "
                             "in a step through flashinfer's ragged prefill; paged: every prompt row through the paged "
                             "kernel; unset: the environment's); a "
                             "comma list runs our engine once per value, the first as 'ours', the others as "
                             "'ours_<mode>' (e.g. paged,ragged)")
    parser.add_argument("--dummy-init", type=_init_list, default=None,
                        help="BULLET_RAY_DUMMY_INIT for our engine's dummy weights (normal, the default: N(0, 0.02), "
                             "norm weights near 1; uniform: every parameter in [-1e-3, 1e-3], as vLLM's dummy loader "
                             "draws them; unset: the environment's); a comma list runs our engine once per value, the "
                             "first as 'ours', the others as 'ours_init<init>' (e.g. normal,uniform)")
    parser.add_argument("--prefill-plan-lead-ms", type=_plan_lead, default=10.0,
                        help="engine.prefill_plan_lead_ms of the bullet and static schedules' prefill worker (ms before "
                             "its step in flight is predicted to end that it plans the next batch; none: at once); "
                             "default 10, the engine's")
    parser.add_argument("--vllm", action="store_true", help="also run vLLM's LLM.generate (child process)")
    parser.add_argument("--vllm-timeout-s", type=float, default=900,
                        help="the vLLM child (start-up ~3 min on the H100, then the run) is killed with its "
                             "process group after this")
    parser.add_argument("--vllm-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help="JSON file (default: print only)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.kv_cache_gb is None:
        args.kv_cache_gb = 56.0 if args.device.startswith("cuda") else 1.0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.vllm_only:
        print("VLLM_RESULT " + json.dumps(run_vllm(args)), flush=True)
        return 0
    with environment(_engine_env(args)):
        results = {"ours": run_ours(args)}
    print(json.dumps(results["ours"]), flush=True)
    save(args, argv, results)  # ours is kept even if vLLM's run, or a `timeout` around this call, ends it later
    # the same run with the projections' other GEMMs, other piecewise limits, other prompt attention: "ours_<name>"
    variants = [(gemm, {"prefill_gemm": [gemm]}) for gemm in args.prefill_gemm[1:]] + \
        [(f"pw{tokens}", {"piecewise_graph_tokens": [tokens]}) for tokens in (args.piecewise_graph_tokens or [])[1:]] + \
        [(mode, {"prefill_attention": [mode]}) for mode in (args.prefill_attention or [])[1:]] + \
        [(f"init{init}", {"dummy_init": [init]}) for init in (args.dummy_init or [])[1:]]
    for name, changed in variants:
        variant = argparse.Namespace(**{**vars(args), **changed, "step_log": _suffixed(args.step_log, name)})
        with environment(_engine_env(variant)):
            results[f"ours_{name}"] = run_ours(variant)
        print(json.dumps(results[f"ours_{name}"]), flush=True)
        save(args, argv, results)
    if args.vllm:
        log_path = (args.out.parent if args.out is not None else Path(tempfile.gettempdir())) / "offline_vllm_child.log"
        results["vllm"] = {"error": "not finished: this process was stopped while vLLM ran"}
        save(args, argv, results)
        results["vllm"] = _vllm_in_child(argv if argv is not None else sys.argv[1:], args.vllm_timeout_s, log_path)
        if "requests_per_s" in results["vllm"]:
            for name in [n for n in results if n.startswith("ours")]:
                results[f"{name}_over_vllm"] = {k: round(results[name][k] / results["vllm"][k], 3)
                                                for k in ("requests_per_s", "output_tokens_per_s")}
    print(json.dumps({k: v for k, v in results.items() if k.startswith("ours") or k == "vllm"}, indent=1))
    if save(args, argv, results):
        print(f"saved {args.out}")
    return 0


def _engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The environment a run's engine is built under: its --prefill-attention mode and --dummy-init, each only when
    given (else the caller's)."""
    env = {"BULLET_RAY_PREFILL_ATTENTION": args.prefill_attention[0]} if args.prefill_attention else {}
    if getattr(args, "dummy_init", None):
        env["BULLET_RAY_DUMMY_INIT"] = args.dummy_init[0]
    return env


def save(args: argparse.Namespace, argv: list[str] | None, results: dict[str, Any]) -> bool:
    """Write what has run so far to `args.out` (False when there is none): the file is rewritten after each
    system, so a run stopped part-way (vLLM past a device call's limit) keeps the systems that finished."""
    if args.out is None:
        return False
    payload = {"benchmark": "offline", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "command": "python -m benchmarks.offline " + " ".join(sys.argv[1:] if argv is None else argv),
               "workload": {"dataset": "azure-conv", "num_prompts": args.num_prompts, "seed": args.seed,
                            "max_total_tokens": args.max_total_tokens, "greedy": True, "ignore_eos": True},
               "device": device_info(), **results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2))
    tmp.replace(args.out)  # never a half-written file
    return True


def vllm_child_env(**extra: str) -> dict[str, str]:
    """The environment of a child process that runs vLLM: its packages ($VLLM_SITE, default /tmp/vsite) first
    on the path, then this repository (offline's and benchmarks.gpu.kernel_compare's children)."""
    repo = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": f"{os.environ.get('VLLM_SITE', '/tmp/vsite')}:{repo}", **extra}


def run_child(cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float,
              result_prefix: str) -> dict[str, Any]:
    """Run `cmd` in its own process group (stderr to `log_path`) and return the JSON its stdout prints after
    `result_prefix`, with `child_s`; {"error", "stderr_tail"} when it fails, prints none, or outlives
    `timeout_s`. Whatever it started is killed with it: on the timeout, and on a signal that stops this
    process (`timeout` around a device call), which would not reach the group on its own."""
    started = time.perf_counter()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, start_new_session=True)

        def on_signal(signum: int, frame: Any) -> None:
            kill_group(proc)
            raise SystemExit(128 + signum)

        previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        timed_out = False
        try:
            stdout, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out, stdout = True, ""
            logger.error("child %s timed out after %.0f s", cmd[2:4], timeout_s)
        finally:
            kill_group(proc)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    for line in (stdout or "").splitlines():
        if line.startswith(result_prefix):
            result: dict[str, Any] = json.loads(line.removeprefix(result_prefix))
            result["child_s"] = round(time.perf_counter() - started, 1)
            return result
    tail = log_path.read_text(errors="replace")[-3000:] if log_path.is_file() else ""
    sys.stderr.write(tail)
    reason = "timed out" if timed_out else f"rc {proc.returncode}"
    return {"error": f"child failed ({reason} after {time.perf_counter() - started:.0f} s; log {log_path})",
            "stderr_tail": tail[-1500:]}


def kill_group(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM the child's process group, then SIGKILL whatever of it is left (the leader may be gone while
    processes it started live on)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _vllm_in_child(argv: list[str], timeout_s: float, log_path: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.offline", *[a for a in argv if a != "--vllm"], "--vllm-only"]
    return run_child(cmd, vllm_child_env(), log_path, timeout_s, "VLLM_RESULT ")


def device_info() -> dict[str, Any]:
    """The GPU (name, SMs) and torch version a run used, or "cpu"."""
    try:
        import torch

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return {"name": props.name, "sms": props.multi_processor_count, "torch": torch.__version__}
    except Exception:  # noqa: BLE001 - the device line is informative only
        pass
    return {"name": "cpu"}


if __name__ == "__main__":
    sys.exit(main())
