#!/bin/bash
cd /work/main
S=bullet-slo-margin50-pl10-mot-fb1000+lt+direct
for D in benchmarks/results/serve_h200_m16/seed10 benchmarks/results/serve_h200_m15/seed9 benchmarks/results/serve_h200_m15/seed8 benchmarks/results/serve_h200_m14/seed7; do
  tag=$(basename $D)
  for share in 0.95 0.99 1.0; do
    for spec in relaxed:40 relaxed:48 relaxed:56 strict:32 strict:40; do
      slo=${spec%:*}; r=${spec#*:}
      [ -f $D/runs/$S-rate$r.json.gz ] || continue
      /tmp/ci7/main/.venv/bin/python -m benchmarks.replay_split --run $D/runs/$S-rate$r.json.gz --steps $D/$S-steps.jsonl.gz --margins 50 --scopes all --seeds 10 --no-progress --prefill-order max_on_time --fallback-ms 1000 --split-rule '{}' --saturation-share $share --score-slo $slo --json /tmp/rep/${tag}_s${share}_r${r}_${slo}.json > /tmp/rep/${tag}_s${share}_r${r}_${slo}.txt 2>&1
    done
  done
done
echo done
