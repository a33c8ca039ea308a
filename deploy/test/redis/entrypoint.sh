#!/bin/sh
# Run redis-server as the redis user, reachable from the other containers.
set -eu
if [ "$1" = redis-server ]; then
    shift
    chown -R redis:redis /data
    exec runuser -u redis -- redis-server --protected-mode no "$@"
fi
exec "$@"
