"""Proof that a client holds a program's bytes, computed the same way by both ends.

Program hashes are published (worker records list what they cache), so naming a hash proves nothing: a worker runs a
cached program only for a client that sent its bytes here, that proves it holds them, or when the program's owner
published it as shared (``Submit.shared``). The proof:

* the **holding key** ``K = sha256("gpunet-holding-v1" || container bytes)``: one pass over the whole program,
  computed once per program by each side and kept (the worker from its disk cache, only when someone first needs
  it). Only whoever had every byte can compute it; unlike ``program_hash`` it is never sent or published;
* a **proof** ``HMAC-SHA256(K, purpose || verifier id || prover id)``: 32 bytes, microseconds once ``K`` is known. It
  names the worker that checks it and the identity that presents it (the peer id the libp2p channel authenticated),
  so a proof seen once is worth nothing elsewhere: replayed by another identity or to another worker, it does not
  verify. No nonce is needed: the only party that could replay it is the prover itself, to the same worker.

Purposes: :data:`RUN` (a client to the worker it submits to: run the copy you hold for me) and :data:`PIECE` (the
client's grant to the worker it sends a job to, presented to each holder that worker fetches pieces from: the holder
is the verifier, the fetching worker the prover).

**Upload tokens.** A worker still receiving a program (from its client, or from peers) cannot compute the holding
key yet, but it can already serve the pieces it has: a cold start of many workers then costs the client one copy,
passed on as it arrives. For that the client gives every worker it sends a program to, or points at holders of it,
its **upload token** for the program (32 random bytes, never derived from the bytes) beside them; a grant made
with the token (``proof(token, PIECE, holder, fetcher)``) lets a fetcher take pieces from such a holder. Only the
client that sent the bytes knows the token, and a holder learns it only with bytes that client sends or points it
at, so a token authorises nothing beyond what its client could hand out itself.
"""

from __future__ import annotations

import hashlib
import hmac

RUN, PIECE = "run", "piece"
PROOF_BYTES = 32
KEY_PREFIX = b"gpunet-holding-v1\0"


def holding_key(program: bytes | bytearray | memoryview) -> bytes:
    """The program's holding key (one pass over its container bytes)."""
    h = hashlib.sha256(KEY_PREFIX)
    h.update(program)
    return h.digest()


def proof(key: bytes, purpose: str, verifier: str, prover: str) -> bytes:
    """What ``prover`` presents to ``verifier`` to show it (or the client behind it) holds the program."""
    return hmac.new(key, f"{purpose}\0{verifier}\0{prover}".encode(), hashlib.sha256).digest()


def verifies(key: bytes, given: bytes | None, purpose: str, verifier: str, prover: str) -> bool:
    return given is not None and hmac.compare_digest(proof(key, purpose, verifier, prover), given)
