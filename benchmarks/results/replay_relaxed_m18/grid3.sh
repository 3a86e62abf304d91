set -u
S=bullet-slo-margin50-pl10-mot-fb1000+lt+direct; D=benchmarks/results/serve_h200_m18/seed12; O=${O:-benchmarks/results/replay_relaxed_m18}; mkdir -p $O
P=.venv/bin/python
for R in 32 40 48 56 64; do
  C="--run $D/runs/$S-rate$R.json.gz --steps $D/$S-steps.jsonl.gz --scopes all --seeds 10 --no-progress --prefill-order max_on_time --score-slo relaxed"
  $P -m benchmarks.replay_split $C --margins 50 --fallback-ms 1000 --ladder 8,16,24,32,40,48,56,64,72,80,88,96,104,112 --json $O/r${R}_served_fl8.json > $O/r${R}_served_fl8.txt 2>&1
  $P -m benchmarks.replay_split $C --margins 0 --slo relaxed --ladder 8,16,24,32,40,48,56,64,72,80,88,96,104,112 --json $O/r${R}_relaxed_fl8.json > $O/r${R}_relaxed_fl8.txt 2>&1
done
echo grid3 done
