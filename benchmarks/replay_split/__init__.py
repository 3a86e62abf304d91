"""Replay one served run through a model of BOTH sides of the bullet schedule and the real split rule, to predict
what a TTFT planning margin (EngineConfig.ttft_margin_ms) and its scope (ttft_margin_scope), the split rule's
settings (`--split-rule`: EngineConfig.split_rule), another split ladder (`--ladder`: EngineConfig.decode_sm_counts), a faster prefill side (`--prefill-speedup`) or a decode pause
the engine does not have (`--decode-pause`: sim.DecodePause) do to SLO attainment (strict, or the preset `--slo` names), TTFT and TPOT. A discrete-event MODEL calibrated on a step log, not a GPU measurement.

What it models:
- the run's arrivals, prompt and output lengths (`scheduled_s`, `prompt_tokens`, `output_tokens_requested`: the
  bench ran with ignore_eos); a request reaches the prefill queue `overhead_ms` / 2 after it is sent, and each of
  its tokens reaches the client `overhead_ms` / 2 after the step that made it ends;
- step times fitted to the same system's step log by least squares, per (SMs, other side busy): prefill = fixed
  + per token + per attention pair, decode = fixed + per sequence + per context token; an entry with fewer than
  `MIN_FIT_STEPS` steps takes the nearest fitted entry's time scaled by the profile's roofline ratio between the
  two (PerfModel without correction). A simulated step takes the fitted time x lognormal noise (median 1, the p90
  of |log| at the log's p90 prediction error of that side, as benchmarks.replay_order does), or with `--noise
  empirical` x a ratio measured / fitted drawn from the log's own steps of that SM entry (else of that side), in
  blocks of consecutive logged steps as long as the log's lag-1 autocorrelation says (noise.py);
- with `--delays log`, the front -> worker and hand-off delays of the run window's `first_token` / `handoff`
  records, less the step-boundary waits modelled below (noise.py's docstring: what is left is ~0);
- the real policy: BulletPolicy (order, batches, SplitRule) with EngineConfig's planning_targets / split_targets /
  split_settings, the deployment's token cap, the default ladder on 132 SMs, and the profile's PerfModel whose
  online correction first learns the log's steps from before the run (the earlier rates the server served;
  `--no-warm`: none), then each simulated prefill step and, at each decision, decode's last step (as
  policy_link.StepRecorder and SplitDecider._observe_decode feed it);
- the engine's timing: prefill plans (and decides the split) as its step before launches, or when a request
  reaches an idle empty side; while prefill idles, a decision at each decode step; a requested split applies to
  each side at its next launch; decode steps while it has sequences; a prefilled sequence joins decode at decode's
  first step boundary `relay_ms` after its prefill step ends, and every decode step gives each running sequence
  one token. TPOT = (last token - first token) / (output tokens - 1).

What it leaves out: the prefill worker's read lag in runs without the plan lead (`prefill_plan_lead_ms: null`: it
reads its pipe and plans after launching its next step, 0.8-24 ms later than the step end the replay plans at; with
the default 10 ms lead it reads arrivals until 10 ms before its step's predicted end, close to what the replay
does), the mixed fallback and
admission (off in the H200 runs), the SM sharing while a switch drains (a step runs wholly on the entry it
launched on), the KV pool, the decode side's launch-ahead, and (with lognormal noise) errors that persist over
steps.

Against the six H200 margin runs (benchmarks/results/replay_split_h200/README.md) it matches 32 req/s and does NOT
reproduce the TPOT collapse measured at 40 req/s with margins 25 / 50.

    python -m benchmarks.replay_split --run benchmarks/results/serve_h200_m3a/runs/bullet-slo+direct-rate40.json.gz \
        --margins 0,50 --scopes all,order --seeds 5 --json out.json
"""

from benchmarks.replay_split.cli import ladder_of, main, make_policy, profile_model_factory, score
from benchmarks.replay_split.fits import StepModel, fit_step_model
from benchmarks.replay_split.noise import Delays, ResidualNoise, delays_from_log, residual_noise
from benchmarks.replay_split.sim import Request, load_requests, replay, steps_before, warm_up

__all__ = ["Delays", "Request", "ResidualNoise", "StepModel", "delays_from_log", "fit_step_model",
           "ladder_of", "load_requests", "main", "make_policy", "profile_model_factory", "replay", "residual_noise",
           "score", "steps_before", "warm_up"]
