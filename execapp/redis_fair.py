"""A fair share of each worker's channel-layer queue per owner (execapp/redis_layer.py uses it).

channels_redis queues every message for a worker process in one Redis sorted set (its process
key) of at most ``capacity`` (1500) messages, read by one receive loop at about one message per
four round trips. Every session frame of every owner for that worker goes through it, and a
group send to a full key drops the message silently. One tenant publishing faster than a worker
reads (measured: 20 connections of /ping events into a session with members on both workers of
two) kept both process keys at 1500: another tenant's session members heard 2-3 of 855 frames
in 10 s, with no ``lagged`` frame; alone they heard all of them.

Here a session frame goes to a queue of its owner's on that worker instead (the process key,
``~``, the owner digest from the group name: ``protocol.group_name``), each of ``capacity``
messages, and the owner's name into the worker's *ready* set, scored by when it became ready.
The receive loop pops the owner that has waited longest from the ready set, takes one message
of its queue and, if more remain, puts the owner back at the end: round robin between owners,
whatever each one sends. A flood fills its own owner's queue only (and is dropped there, as
before); every other owner's frames wait at most one message per other waiting owner.
Messages not of a session (control requests, direct sends) keep the process key, read first.
"""
from __future__ import annotations

import time
from typing import Any

from .protocol import GROUP_PREFIX, OWNER_DIGEST_CHARS

#: Between a worker's process key and an owner digest, or the ready set's suffix.
SEP = "~"
READY = SEP + "ready"
#: A worker's mark that it still reads its queues: set when one of its channels joins a group and
#: at every take (at least every brpop_timeout, 5 s, while it has a reader), lapsing after
#: ALIVE_SECONDS. A session frame for a worker without it is not queued: a killed worker's
#: memberships stay in their groups up to channels_redis' group expiry (a day), and each owner
#: sending to them would otherwise keep a full queue of frames nobody reads in Redis (channels_redis
#: kept one of 1,500 per dead worker the same way).
ALIVE = SEP + "alive"
ALIVE_SECONDS = 15
#: How long a worker's backup queue (channels_redis' "$inflight": the message a receive took, kept
#: until its cleaner removes it, put back by the next take if the receive was cancelled) outlives
#: its last write. channels_redis set no expiry: a worker that stopped (a deploy, SIGKILL) between
#: a take and its cleaner left its last message in Redis for ever, a key per worker process. A live
#: worker takes again within its blocking pop's timeout (5 s), and a message older than the layer's
#: expiry (30 s) is stale anyway.
BACKUP_SECONDS = 60

#: After an owner's queue's key: the bytes of the messages it holds (a string, expiring with it).
BYTES = "#bytes"

#: KEYS: the channel keys of a group send (a process key ends with "!"); ARGV: a message per key,
#: a capacity per key, then the time, the expiry, the owner digest and the bytes one owner's queue
#: may hold. Returns how many were full. An owner's queue is bounded in messages (capacity) and in
#: bytes: 1500 frames of 64 KiB were ~100 MB of the Redis every tenant shares per owner and worker,
#: and one tenant's flood of large session frames filled a Redis to its maxmemory (every session,
#: drain, resend and history write of every tenant failing with OOM until the queues expired).
SEND = """
local n = #KEYS
local now = ARGV[2 * n + 1]
local expiry = tonumber(ARGV[2 * n + 2])
local part = ARGV[2 * n + 3]
local max_bytes = tonumber(ARGV[2 * n + 4])
local full = 0
for i = 1, n do
    local key = KEYS[i]
    local ready = nil
    local alive = 1
    local size = nil
    local held = 0
    if string.sub(key, -1) == '!' then
        ready = key .. '""" + READY + """'
        alive = redis.call('EXISTS', key .. '""" + ALIVE + """')
        key = key .. '""" + SEP + """' .. part
        size = key .. '""" + BYTES + """'
        local old = redis.call('ZRANGEBYSCORE', key, 0, tonumber(now) - expiry)
        if #old > 0 then
            local gone = 0
            for _, m in ipairs(old) do
                gone = gone + #m
            end
            if redis.call('DECRBY', size, gone) <= 0 then
                redis.call('DEL', size)
            end
        end
        held = tonumber(redis.call('GET', size) or '0')
    end
    redis.call('ZREMRANGEBYSCORE', key, 0, tonumber(now) - expiry)
    local fits = held == 0 or held + #ARGV[i] <= max_bytes
    if alive == 1 and fits and redis.call('ZCARD', key) < tonumber(ARGV[n + i]) then
        redis.call('ZADD', key, now, ARGV[i])
        redis.call('EXPIRE', key, expiry)
        if size then
            redis.call('INCRBY', size, #ARGV[i])
            redis.call('EXPIRE', size, expiry)
        end
        if ready then
            redis.call('ZADD', ready, 'NX', now, part)
            redis.call('EXPIRE', ready, expiry)
        end
    else
        full = full + 1
    end
end
return full
"""

#: ARGV: the process key, its backup queue, the ready set, the time. Without blocking: marks the
#: worker alive, puts back
#: what a cancelled receive had taken (channels_redis' backup queue), then takes the oldest message
#: of the process key, else of the owner that has waited longest (back at the end of the ready set
#: while its queue holds more), into the backup; false when there is none. One round trip a message
#: while messages wait (channels_redis' receive took three, plus its cleaner's one).
NEXT = """
redis.call('SET', ARGV[1] .. '""" + ALIVE + """', '1', 'EX', """ + str(ALIVE_SECONDS) + """)
local backed_up = redis.call('ZRANGE', ARGV[2], 0, -1, 'WITHSCORES')
for i = #backed_up, 1, -2 do
    redis.call('ZADD', ARGV[1], backed_up[i], backed_up[i - 1])
end
redis.call('DEL', ARGV[2])
local m = redis.call('ZPOPMIN', ARGV[1])
while #m == 0 do
    local r = redis.call('ZPOPMIN', ARGV[3])
    if #r == 0 then
        return false
    end
    local queue = ARGV[1] .. '""" + SEP + """' .. r[1]
    m = redis.call('ZPOPMIN', queue)
    if #m > 0 and redis.call('DECRBY', queue .. '""" + BYTES + """', #m[1]) <= 0 then
        redis.call('DEL', queue .. '""" + BYTES + """')
    end
    if #m > 0 and redis.call('ZCARD', queue) > 0 then
        redis.call('ZADD', ARGV[3], ARGV[4], r[1])
    end
end
redis.call('ZADD', ARGV[2], m[2], m[1])
redis.call('EXPIRE', ARGV[2], """ + str(BACKUP_SECONDS) + """)
return m[1]
"""


def owner_part(group: str) -> str:
    """The owner digest of a session's group (``protocol.group_name``), "" for any other group."""
    if not group.startswith(GROUP_PREFIX):
        return ""
    return group[len(GROUP_PREFIX):len(GROUP_PREFIX) + OWNER_DIGEST_CHARS]


async def take(connection: Any, key: str, backup: str, timeout: float) -> Any:
    """The next message for the worker whose process key is ``key``: from the process key first,
    else from the owner that has waited longest; None after ``timeout`` with nothing."""
    ready = key + READY
    while True:
        message = await connection.eval(NEXT, 0, key, backup, ready, time.time())
        if message:
            return message
        # Nothing waits: block until something does (a message, or an owner made ready).
        result = await connection.bzpopmin([key, ready], timeout=timeout)
        if result is None:
            return None
        source, member, score = result
        if source.decode() == key:
            pipe = connection.pipeline(transaction=False)
            pipe.zadd(backup, {member: float(score)})
            pipe.expire(backup, BACKUP_SECONDS)
            await pipe.execute()
            return member
        await connection.zadd(ready, {member: float(score)})  # the owner's turn, taken by NEXT
