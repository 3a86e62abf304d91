set -u
S=bullet-slo-margin50-pl10-mot-fb1000+lt+direct; D=benchmarks/results/serve_h200_m18/seed12; O=${O:-benchmarks/results/replay_relaxed_m18}; mkdir -p $O
P=.venv/bin/python
for R in 32 40 48 56 64; do
  C="--run $D/runs/$S-rate$R.json.gz --steps $D/$S-steps.jsonl.gz --scopes all --seeds 10 --no-progress --prefill-order max_on_time --score-slo relaxed"
  $P -m benchmarks.replay_split $C --margins 50 --fallback-ms 1000 --decode-pause 1.1 --decode-pause-reasons at_risk --json $O/r${R}_served_pauseR.json > $O/r${R}_served_pauseR.txt 2>&1
  $P -m benchmarks.replay_split $C --margins 0 --slo relaxed --decode-pause 1.1 --decode-pause-reasons at_risk --json $O/r${R}_relaxed_pauseR.json > $O/r${R}_relaxed_pauseR.txt 2>&1
  $P -m benchmarks.replay_split $C --margins 0 --slo relaxed --decode-pause 1.18 --decode-pause-reasons at_risk --json $O/r${R}_relaxed_pauseR118.json > $O/r${R}_relaxed_pauseR118.txt 2>&1
done
[ -f $O/r64_relaxed.json ] || $P -m benchmarks.replay_split --run $D/runs/$S-rate64.json.gz --steps $D/$S-steps.jsonl.gz --scopes all --seeds 10 --no-progress --prefill-order max_on_time --score-slo relaxed --margins 0 --slo relaxed --json $O/r64_relaxed.json > $O/r64_relaxed.txt 2>&1
echo grid2 done
