#!/usr/bin/env bash
# Start Prometheus (Debian's `prometheus` package) scraping a running bullet_ray deployment, in the foreground.
#
#   bash deploy/prometheus.sh                      # port 9090, Ray's node list, data in /tmp/bullet_ray_prometheus
#   bash deploy/prometheus.sh --port 9191 --data-dir /tmp/prom2
#   bash deploy/prometheus.sh --target 127.0.0.1:8080 --scrape-interval 1s   # fixed targets instead of Ray's list
#
# Run it on the Ray head node: Ray writes every node's metrics export address to --sd-file (default
# /tmp/ray/prom_metrics_service_discovery.json), which Prometheus re-reads as nodes come and go (file service
# discovery, as deploy/prometheus.yml does). Then point the controller at it (`controller: {prometheus_url:
# http://<head>:9090}`) and a Grafana at it (README "Operate it"; dashboards/provisioning). Ctrl-C stops it.
# PROMETHEUS_BIN=/path/to/prometheus uses that binary instead of the one on PATH.
set -euo pipefail
PORT=9090
DATA_DIR=/tmp/bullet_ray_prometheus
SD_FILE=/tmp/ray/prom_metrics_service_discovery.json
INTERVAL=5s
LISTEN=0.0.0.0
TARGETS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT=$2; shift 2 ;;
    --data-dir) DATA_DIR=$2; shift 2 ;;
    --sd-file) SD_FILE=$2; shift 2 ;;
    --target) TARGETS+=("$2"); shift 2 ;;
    --scrape-interval) INTERVAL=$2; shift 2 ;;
    --listen) LISTEN=$2; shift 2 ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "deploy/prometheus.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
BIN=${PROMETHEUS_BIN:-$(command -v prometheus || true)}
if [ -z "$BIN" ]; then
  echo "deploy/prometheus.sh: prometheus not found; install it: apt-get install -y prometheus" >&2
  exit 1
fi
mkdir -p "$DATA_DIR"
CONFIG="$DATA_DIR/prometheus.yml"
{
  echo "# written by deploy/prometheus.sh"
  echo "global: {scrape_interval: $INTERVAL, evaluation_interval: $INTERVAL}"
  echo "scrape_configs:"
  echo "  - job_name: ray"
  if [ ${#TARGETS[@]} -gt 0 ]; then
    printf '    static_configs:\n      - targets: ['
    (IFS=,; printf '%s' "${TARGETS[*]/#/\"}" | sed 's/,/",/g; s/$/"/')
    printf ']\n'
  else
    echo "    file_sd_configs:"
    echo "      - files: [\"$SD_FILE\"]"
  fi
} > "$CONFIG"
echo "prometheus on http://$LISTEN:$PORT, config $CONFIG, data $DATA_DIR" >&2
exec "$BIN" --config.file="$CONFIG" --storage.tsdb.path="$DATA_DIR/data" --web.listen-address="$LISTEN:$PORT" \
  --storage.tsdb.retention.time=2d --log.level=warn
