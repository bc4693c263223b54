# The local broker for a script that needs it for a while: start it unless it already answers, and stop it
# afterwards only if this script started it, so a broker someone else runs outlives the script.
# Sourced (`. scripts/lib/broker.sh`), not run.

# broker_up VLMSTREAM: starts the local broker with that `vlmstream` executable (`broker start` reuses one that
# runs); BROKER_STARTED_HERE=1 when none answered before. Returns `broker start`'s status.
broker_up() {
  local vlmstream=$1 status
  status=$("$vlmstream" broker status 2>/dev/null) || true
  BROKER_STARTED_HERE=1
  [[ $status == *'"answers": true'* ]] && BROKER_STARTED_HERE=0
  "$vlmstream" broker start
}

# broker_down VLMSTREAM REASON: stops the local broker, with REASON in its stops.log, if broker_up started it;
# a failed stop is not the script's failure.
broker_down() {
  local vlmstream=$1 reason=$2
  [ "${BROKER_STARTED_HERE:-0}" = 1 ] || return 0
  "$vlmstream" broker stop --reason "$reason" || true
}
