#!/usr/bin/env bash
# Starts the local Redis and PostgreSQL servers the tests use, if they are not already up.
# Tests that need them skip with a visible reason when they still cannot be reached.
set -u
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
    if command -v redis-server >/dev/null; then
        mkdir -p /tmp/spec-batch-redis
        redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
            --dir /tmp/spec-batch-redis --logfile /tmp/spec-batch-redis/redis.log || true
    fi
fi
if ! pg_isready -h 127.0.0.1 -p 5432 >/dev/null 2>&1; then
    if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
        pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
    fi
fi
exit 0
