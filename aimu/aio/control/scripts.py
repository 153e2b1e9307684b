"""The Lua scripts that make each control step atomic in Redis.

A request is recorded in the run's request stream and published in one script, so it
is durable before any worker hears of it. A worker's writes (events, status, lease)
check that the run is still its own, so a worker that lost its run to a claim cannot
write into it. Event batches carry client-side numbers, so a batch re-sent after an
ambiguous failure is appended once.

Every script answers the same way: a list whose first item is a tag (``ok``, or what
went otherwise: ``busy``, ``finished``, ``gone``, ``not_ours``, ``ended``, ``unknown``,
``alive``, ``not_lost``, ``exists``), then that outcome's values (see :class:`ScriptReply`).

A run's record and streams expire ``retention`` seconds after the last sign of life:
its end, or (while it runs) its worker's last heartbeat, so a lost run expires too. The
key ``PREFIX:session:NAME`` names the latest run of a session (``info["session"]``): a
lost run whose session starts again elsewhere is closed as ``cancelled``, saying so.

Run hash fields: status, worker, name, attempt, created_at, started_at, ended_at,
reason, error, info (JSON), seq (events appended), pub (last batch number of this
attempt), requests_seen (the last request the worker applied), result and usage
(JSON, once it ended).
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple

__all__ = [
    "CLAIM", "PAUSED", "PUBLISH", "REGISTER", "RENEW", "REQUEST", "RESERVE", "STANDING",
    "WENT_ON", "ScriptReply", "reply",
]

#: How the reason of a lost run closed because its session went on begins (the new
#: run's id follows).
WENT_ON: Final = "lost: its worker stopped, and the session went on in run "

#: How many runs of the runs list each registration checks, dropping those whose record
#: expired. A cursor walks the whole list round and round, so a run that lives long at
#: its head never stops the pruning: the list stays bounded without anyone calling runs().
PRUNE = 32

#: The Lua that a lost run of the session is closed with, and the latest run noted.
_SESSION = f"""
local function note_latest(session_key, run_id, now, retention, prefix)
  if session_key == '' then return end
  local previous = redis.call('GET', session_key)
  if previous and previous ~= run_id then
    local old = prefix .. 'run:' .. previous
    if redis.call('HGET', old, 'status') == 'running'
       and redis.call('EXISTS', old .. ':lease') == 0 then
      redis.call('HSET', old, 'status', 'cancelled', 'ended_at', now, 'reason',
                 '{WENT_ON}' .. run_id)
      redis.call('EXPIRE', old, retention)
    end
  end
  redis.call('SET', session_key, run_id, 'EX', retention)
end
"""

#: KEYS run, lease, runs, requests, session ('' key: none), prune cursor; ARGV worker,
#: lease_ms, now, name, info, run_id, fresh, key prefix ('P:'), PRUNE, retention_s.
#: -> {'ok', requests_seen, pending requests} | {'busy', holder} | {'finished', status}
REGISTER = _SESSION + """
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then return {'busy', holder} end
local status = redis.call('HGET', KEYS[1], 'status')
if status and status ~= 'pending' and status ~= 'running' then return {'finished', status} end
local owner = redis.call('HGET', KEYS[1], 'worker')
if owner and owner ~= ARGV[1] then return {'busy', owner} end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
if ARGV[7] == '1' then
  redis.call('HINCRBY', KEYS[1], 'attempt', 1)
  redis.call('HSET', KEYS[1], 'pub', 0, 'started_at', ARGV[3], 'name', ARGV[4])
  if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'info', ARGV[5]) end
else
  redis.call('HSETNX', KEYS[1], 'pub', 0)
  redis.call('HSETNX', KEYS[1], 'started_at', ARGV[3])
  redis.call('HSETNX', KEYS[1], 'name', ARGV[4])
  redis.call('HSETNX', KEYS[1], 'attempt', 1)
  if ARGV[5] ~= '' then redis.call('HSETNX', KEYS[1], 'info', ARGV[5]) end
end
redis.call('HSET', KEYS[1], 'status', 'running', 'worker', ARGV[1])
redis.call('HSETNX', KEYS[1], 'created_at', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[10])
redis.call('EXPIRE', KEYS[4], ARGV[10])
redis.call('ZADD', KEYS[3], 'NX', ARGV[3], ARGV[6])
if KEYS[5] ~= ARGV[8] .. 'session:' then
  note_latest(KEYS[5], ARGV[6], ARGV[3], ARGV[10], ARGV[8])
end
local cursor = redis.call('GET', KEYS[6]) or '-inf'
local batch = redis.call('ZRANGEBYSCORE', KEYS[3], cursor, '+inf', 'WITHSCORES',
                         'LIMIT', 0, tonumber(ARGV[9]))
for i = 1, #batch, 2 do
  if redis.call('EXISTS', ARGV[8] .. 'run:' .. batch[i]) == 0 then
    redis.call('ZREM', KEYS[3], batch[i])
  end
end
if #batch < 2 * tonumber(ARGV[9]) then
  redis.call('DEL', KEYS[6])
else
  redis.call('SET', KEYS[6], '(' .. batch[#batch])
end
local seen = redis.call('HGET', KEYS[1], 'requests_seen') or '0-0'
return {'ok', seen, redis.call('XRANGE', KEYS[4], '(' .. seen, '+')}
"""

#: KEYS run, events, lease, requests; ARGV worker, maxlen, final status ('' while
#: running), reason, error, ended_at, retention_s, requests_seen (''), result, usage,
#: then triples (batch number, type, JSON).
#: -> {'ok', last batch number appended, {number, seq, stream id} of each event this call
#: appended, flat} | {'not_ours'} | {'gone'}: the record is gone (Redis restarted empty,
#: or it expired): register again.
PUBLISH = """
local owner = redis.call('HGET', KEYS[1], 'worker')
if not owner then return {'gone'} end
if owner ~= ARGV[1] then return {'not_ours'} end
local status = redis.call('HGET', KEYS[1], 'status')
local pub = tonumber(redis.call('HGET', KEYS[1], 'pub') or '0')
if status ~= 'running' then
  if status == 'pending' then return {'not_ours'} end
  return {'ok', pub, {}}
end
local appended = {}
local i = 11
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  if n > pub then
    local seq = redis.call('HINCRBY', KEYS[1], 'seq', 1)
    local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*',
                          'seq', seq, 'type', ARGV[i + 1], 'data', ARGV[i + 2])
    appended[#appended + 1] = n
    appended[#appended + 1] = seq
    appended[#appended + 1] = id
    pub = n
  end
  i = i + 3
end
redis.call('HSET', KEYS[1], 'pub', pub)
if ARGV[8] ~= '' then redis.call('HSET', KEYS[1], 'requests_seen', ARGV[8]) end
redis.call('EXPIRE', KEYS[2], ARGV[7])
if ARGV[3] ~= '' then
  redis.call('HSET', KEYS[1], 'status', ARGV[3], 'reason', ARGV[4], 'error', ARGV[5],
             'ended_at', ARGV[6], 'result', ARGV[9], 'usage', ARGV[10])
  redis.call('DEL', KEYS[3])
  redis.call('EXPIRE', KEYS[1], ARGV[7])
  redis.call('EXPIRE', KEYS[4], ARGV[7])
end
return {'ok', pub, appended}
"""

#: KEYS run, lease, requests, events, session; ARGV worker, lease_ms, requests cursor,
#: retention_s, run_id.
#: -> {'ok', requests after the cursor} | {'not_ours'} | {'gone'}: the record is gone
#: | {'ended'}: its end was written while this renewal was on its way.
RENEW = """
local owner = redis.call('HGET', KEYS[1], 'worker')
if not owner then return {'gone'} end
if owner ~= ARGV[1] then return {'not_ours'} end
if redis.call('HGET', KEYS[1], 'status') ~= 'running' then return {'ended'} end
local holder = redis.call('GET', KEYS[2])
if holder and holder ~= ARGV[1] then return {'not_ours'} end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
redis.call('EXPIRE', KEYS[1], ARGV[4])
redis.call('EXPIRE', KEYS[3], ARGV[4])
redis.call('EXPIRE', KEYS[4], ARGV[4])
if redis.call('GET', KEYS[5]) == ARGV[5] then redis.call('EXPIRE', KEYS[5], ARGV[4]) end
return {'ok', redis.call('XRANGE', KEYS[3], '(' .. ARGV[3], '+')}
"""

#: KEYS run, lease; ARGV claimer, lease_ms.
#: -> {'ok'} | {'unknown'} | {'not_lost', status} | {'alive', holder}
CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown'} end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'running' then return {'not_lost', status} end
local holder = redis.call('GET', KEYS[2])
if holder then return {'alive', holder} end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
redis.call('HSET', KEYS[1], 'worker', ARGV[1])
return {'ok'}
"""

#: KEYS run, lease. -> {status or false, worker or false, 1 if leased else 0}: what a
#: follower checks while its run is quiet, read at one instant in one round trip.
STANDING = """
local fields = redis.call('HMGET', KEYS[1], 'status', 'worker')
return {fields[1], fields[2], redis.call('EXISTS', KEYS[2])}
"""

#: KEYS run, requests; ARGV kind, JSON data, channel base, run_id.
#: -> {'ok', request id} | {'unknown'} | {'finished', status}
REQUEST = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown'} end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'pending' and status ~= 'running' then return {'finished', status} end
local id = redis.call('XADD', KEYS[2], 'MAXLEN', '~', 1000, '*', 'kind', ARGV[1], 'data', ARGV[2])
local ttl = redis.call('PTTL', KEYS[1])
if ttl > 0 then redis.call('PEXPIRE', KEYS[2], ttl) end
local worker = redis.call('HGET', KEYS[1], 'worker')
if worker then
  redis.call('PUBLISH', ARGV[3] .. worker, cjson.encode({run = ARGV[4], id = id}))
end
return {'ok', id}
"""

#: KEYS run; ARGV new status ('pending': its resumed part registers next; or an end
#: status), reason, now, the status it must have (paused, or how a part that handed the
#: run on ended). Only a record with that status changes.
#: -> {'ok'} | {'unknown'} | {'finished', status}
PAUSED = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {'unknown'} end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= ARGV[4] then return {'finished', status} end
if ARGV[1] == 'pending' then
  redis.call('HSET', KEYS[1], 'status', 'pending')
  redis.call('HDEL', KEYS[1], 'worker', 'ended_at', 'reason', 'error', 'result', 'usage')
else
  redis.call('HSET', KEYS[1], 'status', ARGV[1], 'reason', ARGV[2], 'ended_at', ARGV[3])
end
return {'ok'}
"""

#: KEYS run, runs, session; ARGV now, info, ttl_s, run_id, key prefix ('P:').
#: -> {'ok'} | {'exists'}
RESERVE = _SESSION + """
if redis.call('EXISTS', KEYS[1]) == 1 then return {'exists'} end
redis.call('HSET', KEYS[1], 'status', 'pending', 'created_at', ARGV[1], 'attempt', 0)
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], 'info', ARGV[2]) end
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[4])
if KEYS[3] ~= ARGV[5] .. 'session:' then
  note_latest(KEYS[3], ARGV[4], ARGV[1], ARGV[3], ARGV[5])
end
return {'ok'}
"""


class ScriptReply(NamedTuple):
    """A script's answer: its tag, then the outcome's values."""

    tag: str
    values: tuple[Any, ...]


def reply(raw: object) -> ScriptReply:
    """A script's raw answer as a :class:`ScriptReply`; ValueError if it is not one."""
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise ValueError(f"a control script answered {raw!r:.100}, not [tag, ...]")
    return ScriptReply(raw[0], tuple(raw[1:]))
