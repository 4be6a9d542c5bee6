# Sourced by the client scripts: a server in the background, up once it answers /health.
#
#   start_server PORT LOG CMD...   sets SERVER_PID; exits with the log's tail if the server dies
#                                  or is not healthy within 120 s
#   stop_server PID
start_server() {
    local port=$1 log=$2
    shift 2
    "$@" > "$log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 120); do
        curl -sf "localhost:$port/health" > /dev/null && return 0
        kill -0 "$SERVER_PID" 2>/dev/null || break
        sleep 1
    done
    echo "$1 on port $port is dead or not healthy after 120 s; its log ends:" >&2
    tail -30 "$log" >&2
    exit 1
}

stop_server() {
    kill "$1" 2>/dev/null
    wait "$1" 2>/dev/null || true
}
