#!/usr/bin/env bash
# A private, throwaway PostgreSQL cluster for tests.
#
#   scripts/pg-test-cluster.sh start DIR   initdb (first time) + start; prints the connection URL
#   scripts/pg-test-cluster.sh stop DIR    fast shutdown (no error when not running)
#   scripts/pg-test-cluster.sh url DIR     prints the connection URL of DIR's cluster
#
# The cluster lives entirely in DIR (data, Unix socket, log, port file), listens on 127.0.0.1
# only, on a free port picked at the first start and reused on later starts so a restarted
# server keeps its URL (pools reconnect to the same address). Auth is trust: never use it for
# anything but tests. A system cluster, if any, is never touched.
#
# On a fresh machine (scripts/test.sh, .ci/run) the server programs are missing: as root they are
# installed from Debian's archive (apt-get update, then apt-get install -y postgresql
# postgresql-contrib, non-interactive); as another user the script stops with that command.
# As root the server runs as the `postgres` user (created if missing), because initdb refuses to
# run as root.
set -euo pipefail

die() {
  echo "pg-test-cluster: $*" >&2
  exit 1
}

usage() { die "usage: $0 start|stop|url DIR"; }

[[ $# -eq 2 ]] || usage
cmd=$1
dir=$2

# Debian keeps the server programs in PostgreSQL's versioned lib folder, not on PATH; ask dpkg
# where the installed packages put initdb. A version folder may hold client programs only, so
# take the newest folder that has all the server programs, not merely the newest folder.
find_pgbin() {
  local candidate
  while read -r candidate; do
    if [[ -x $candidate/initdb && -x $candidate/pg_ctl && -x $candidate/postgres ]]; then
      echo "$candidate"
      return 0
    fi
  done < <(dpkg-query -S '*/bin/initdb' 2>/dev/null | sed 's/^[^:]*: //; s|/initdb$||' | sort -rV)
}

ensure_installed() {
  PGBIN=$(find_pgbin)
  if [[ -z $PGBIN ]]; then
    [[ $(id -u) -eq 0 ]] || die "PostgreSQL server programs are missing (dpkg knows no initdb);" \
      "as root: apt-get update && apt-get install -y postgresql postgresql-contrib"
    echo "pg-test-cluster: installing PostgreSQL from Debian's archive (apt-get)" >&2
    export DEBIAN_FRONTEND=noninteractive
    # Wait for a dpkg lock held by another install (two test processes on a fresh machine).
    apt-get -o DPkg::Lock::Timeout=300 update >&2 || die "apt-get update failed"
    apt-get -o DPkg::Lock::Timeout=300 install -y postgresql postgresql-contrib >&2 \
      || die "apt-get install postgresql postgresql-contrib failed"
    PGBIN=$(find_pgbin)
    [[ -n $PGBIN ]] || die "installed postgresql but dpkg lists no initdb with pg_ctl and postgres beside it"
  fi
  # initdb refuses to run as root: as root the cluster belongs to the `postgres` user, which the
  # package creates. Server programs present without that user (copied in, user removed): make
  # it, as the package would (a system user with its own group, no login shell).
  if [[ $(id -u) -eq 0 ]] && ! id postgres >/dev/null 2>&1; then
    echo "pg-test-cluster: creating the missing system user 'postgres'" >&2
    useradd --system --user-group --home-dir /var/lib/postgresql --no-create-home \
      --shell /usr/sbin/nologin postgres || die "cannot create the system user 'postgres'"
  fi
  return 0
}

# Run a server program as the cluster's owner.
as_owner() {
  if [[ $(id -u) -eq 0 ]]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

port_in_use() {
  python3 - "$1" <<'EOF'
import socket, sys
s = socket.socket()
# As the server does: a port left in TIME_WAIT by the previous run is free to listen on.
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(0)
finally:
    s.close()
sys.exit(1)
EOF
}

data=$dir/data
sock=$dir/sock
portfile=$dir/port
logfile=$dir/server.log

url() {
  [[ -s $portfile ]] || die "no cluster started in $dir"
  echo "postgresql://postgres@127.0.0.1:$(cat "$portfile")/postgres"
}

running() {
  [[ -f $data/PG_VERSION ]] && as_owner "$PGBIN/pg_ctl" -D "$data" status >/dev/null 2>&1
}

start() {
  ensure_installed
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  data=$dir/data sock=$dir/sock portfile=$dir/port logfile=$dir/server.log
  # One start at a time per DIR (two test processes may race to start the same cluster). The
  # server must not inherit this descriptor, or it would hold the lock for its whole life.
  exec 9>"$dir/.lock"
  flock 9
  if [[ $(id -u) -eq 0 ]]; then
    chown postgres: "$dir"
    runuser -u postgres -- test -w "$dir" || die "$dir is not reachable by user postgres (a parent is private?)"
  fi
  if [[ ! -f $data/PG_VERSION ]]; then
    rm -rf "$data"
    as_owner mkdir -p "$data" "$sock"
    as_owner "$PGBIN/initdb" -D "$data" -U postgres --auth=trust -E UTF8 --locale=C.UTF-8 >"$dir/initdb.log" 2>&1 \
      || die "initdb failed; see $dir/initdb.log"
  fi
  if running; then
    url
    return 0
  fi
  local attempt port
  for attempt in 1 2 3 4 5; do
    port=""
    if [[ -s $portfile ]] && ! port_in_use "$(cat "$portfile")"; then
      port=$(cat "$portfile")
    elif [[ -s $portfile && $attempt -eq 1 ]]; then
      # The recorded port was taken while we were down: wait briefly for it (a restart keeps
      # the URL stable), then fall back to a new one.
      sleep 1
      continue
    else
      port=$(free_port)
    fi
    echo "$port" >"$portfile"
    if as_owner "$PGBIN/pg_ctl" -D "$data" -l "$logfile" -w -t 60 \
      -o "-p $port -k $sock -c listen_addresses=127.0.0.1" start >/dev/null 2>&1 9>&-; then
      url
      return 0
    fi
    # Lost a race for the port (or another start failure): try a fresh port.
    rm -f "$portfile"
  done
  tail -n 20 "$logfile" >&2 || true
  die "could not start PostgreSQL in $dir"
}

stop() {
  PGBIN=$(find_pgbin)
  [[ -n $PGBIN && -d $dir ]] || return 0
  if running; then
    as_owner "$PGBIN/pg_ctl" -D "$data" -m fast -w -t 60 stop >/dev/null
  fi
}

case $cmd in
  start) start ;;
  stop) stop ;;
  url) url ;;
  *) usage ;;
esac
