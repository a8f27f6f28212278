"""Protocol fuzzing: hypothesis strategies for frames that are almost right, and the harness that fires them at
real daemons. tests/integration/test_fuzz.py runs a small sample in CI; tests/fuzz_stack.py runs long ones.

By concept: `strategies` (what is sent), `checks` (what must happen, and the good session), `targets` (what is
fuzzed, one class each), `stack` (the processes under fuzz), `run` (firing a target's cases, all targets in turn).

Four targets, each a real process on 127.0.0.1:

- `ClientSocket`: a DEALER on the broker's client socket sends random frames and mutated valid requests of
  every command (bytes flipped in the msgpack header, fields replaced by values of other types, huge numbers,
  unicode, nesting, frames dropped or repeated, wrong version, payload frames, live sessions of another client).
- `WorkerSocket`: DEALERs posing as workers send mutated control messages (READY, HEARTBEAT, DISCONNECT...)
  and answers (REPLY, CHUNKS, ERROR) addressed to real clients; only a registered fake's are forwarded.
- `HostilePeers`: the same socket from peers that answer without registering (FANOUTs with bad parts, answers
  to real clients), oversized READYs (200k sessions, more slots than the broker takes), beside a registered fake
  sending FANOUTs whose parts are no CHUNKS header and whose routes are no client.
- `WorkerLink`: a ROUTER posing as the broker drives a real `worker start` with mutated routed requests and
  control messages, answering its READY and heartbeating like a broker.

What is checked, case by case and at every checkpoint (a batch of cases):
- a message the protocol module rejects is answered with that error code and request id wherever an answer
  is possible (the client socket: always; a worker: when the header names a valid route and request id);
- an answer a registered worker sends to a real client's route arrives at that client untouched, a stranger's
  never; every admissible READY is welcomed and every other refused with an ERROR (or, over its peer's rate, not
  answered); everything a daemon sends decodes;
- a good session, made before fuzzing on the real worker, generates exactly the same greedy tokens as it did
  before (the model is deterministic), all the while (`GoodSession`, a thread) or between batches;
- every process is alive, the worker heartbeats, and the broker's accounting returns to baseline.
A failed check raises `FuzzFailure` naming the check, the frames of the batch and the daemons' tracebacks.
"""
