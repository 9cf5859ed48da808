"""Changes to how hivemind's DHT nodes treat dictionary values (gpunet's worker buckets), so that no one peer
can hide the network from everyone else.

hivemind validates a dictionary value all-or-nothing: one entry that fails validation drops the whole dictionary, so a
single bad record in a bucket (or a hostile node serving one) hid every worker in it. And nothing bounds a dictionary,
so a few hundred padded sybil records pushed a bucket's reply past the p2p daemon's 4 MiB message cap, and readers got
nothing at all. Here:

* dictionaries are validated **entry by entry**: invalid entries are dropped and the rest kept, both when a peer asks
  us to store them and when we read them from a peer;
* a node stores at most :data:`MAX_BUCKET_ENTRIES` subkeys per key (a known subkey may always refresh; a new one is
  refused while the key is full);
* a reply carries at most :data:`MAX_REPLY_VALUE_BYTES` of one dictionary, smallest entries first (honest records are
  small; padding costs an attacker its place), so a listing degrades to a partial answer, never an empty one;
* a peer's answer is not taken at its word: a dictionary's expiration is recomputed from its valid entries (an empty
  one with expiration ``inf`` ended searches and was cached forever), and nothing is stored "in the cache" (a cached
  copy with a later expiration stood in for the stored bucket). gpunet's nodes also do not cache search results
  (``cache_locally=False, cache_nearest=0`` in :func:`gpunet.dht.network.join`): a listing always reads the latest.

hivemind has no hook for these, so :func:`install` replaces five methods on hivemind's classes, once, in this
process (a DHT process forked after it inherits them). What each replacement does is small and tested against
hivemind's own types in ``tests/test_dht_hardening.py``.
"""

from __future__ import annotations

import logging
import math

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2PContext
from hivemind.proto import dht_pb2
from hivemind.utils import ValueWithExpiration

logger = logging.getLogger(__name__)

#: Subkeys one node keeps under one key: 1,024 records of at most 4 KiB stay under the daemon's 4 MiB message cap,
#: and 64 buckets of 1,024 leave room for 65,536 workers.
MAX_BUCKET_ENTRIES = 1024
#: Bytes of one dictionary a node puts in one reply (the rest of the reply, and the framing, fit in what is left).
MAX_REPLY_VALUE_BYTES = 3 * 2**20

_installed = False


def validate_entries(protocol: DHTProtocol, key_bytes: bytes, dictionary: DictionaryDHTValue) -> bool:
    """Drop the entries of ``dictionary`` that fail validation; keep the others. Always True: an empty dictionary is
    an answer (nobody there), not a reason to discard what other entries or other peers say."""
    validator = protocol.record_validator
    if validator is None:
        return True
    bad = []
    with dictionary.freeze():
        for subkey, (value_bytes, expiration_time) in dictionary.items():
            try:
                subkey_bytes = protocol.serializer.dumps(subkey)
                valid = isinstance(value_bytes, bytes) and validator.validate(
                    DHTRecord(key_bytes, subkey_bytes, value_bytes, expiration_time))
            except Exception:  # a peer's garbage must not end the whole reply
                valid = False
            if not valid:
                bad.append(subkey)
        for subkey in bad:
            del dictionary[subkey]
    if bad:
        logger.debug("dropped %d invalid entr%s of one dictionary", len(bad), "y" if len(bad) == 1 else "ies")
    return True


def trim_dictionary(dictionary: DictionaryDHTValue, budget: int) -> DictionaryDHTValue:
    """A copy of ``dictionary`` whose entries fit ``budget`` bytes, smallest entries first."""
    entries = sorted(dictionary.items(), key=lambda item: (len(item[1].value), -item[1].expiration_time))
    trimmed = DictionaryDHTValue(dictionary.maxsize)
    used = 64
    with trimmed.freeze():
        for subkey, (value, expiration_time) in entries:
            used += len(value) + 96  # the subkey (a peer id), the expiration, msgpack framing
            if used > budget:
                break
            trimmed.store(subkey, value, expiration_time)
    return trimmed


def _store_subkey(self: DHTLocalStorage, key, subkey, value, expiration_time) -> bool:
    current = self.get(key)
    if (current is not None and isinstance(current.value, DictionaryDHTValue) and subkey not in current.value
            and len(current.value) >= MAX_BUCKET_ENTRIES):
        return False
    return _original_store_subkey(self, key, subkey, value, expiration_time)


async def _call_find(self: DHTProtocol, peer, keys):
    """A peer's answer, its claims checked: a dictionary's expiration is recomputed from the entries that survived
    validation (a peer claiming ``inf`` for an empty dictionary would end a latest-value search at once, and be cached
    forever); an emptied dictionary counts as "not found", not as an answer."""
    output = await _original_call_find(self, peer, keys)
    if not output:
        return output
    for key, (found, nearest) in list(output.items()):
        if found is None or not isinstance(found.value, DictionaryDHTValue):
            continue
        expirations = [item.expiration_time for _, item in found.value.items()]
        latest = max(expirations, default=None)
        if latest is None or not math.isfinite(latest):
            output[key] = None, nearest
        else:
            found.value.latest_expiration_time = latest
            output[key] = ValueWithExpiration(found.value, latest), nearest
    return output


async def _rpc_store(self: DHTProtocol, request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
    """Stores as if ``in_cache`` were never set: hivemind answers a find from its cache when the cached copy expires
    later, so one signed record pushed "into the cache" with a long expiration stood in for a whole bucket."""
    for i in range(len(request.in_cache)):
        request.in_cache[i] = False
    return await _original_rpc_store(self, request, context)


async def _rpc_find(self: DHTProtocol, request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
    response = await _original_rpc_find(self, request, context)
    for result in response.results:
        if result.type == dht_pb2.FOUND_DICTIONARY and len(result.value) > MAX_REPLY_VALUE_BYTES:
            dictionary = self.serializer.loads(result.value)
            kept = trim_dictionary(dictionary, MAX_REPLY_VALUE_BYTES)
            logger.warning("a DHT bucket holds %d bytes in %d entries; serving the %d smallest", len(result.value),
                           len(dictionary), len(kept))
            result.value = self.serializer.dumps(kept)
    return response


_original_store_subkey = DHTLocalStorage.store_subkey
_original_rpc_find = DHTProtocol.rpc_find
_original_rpc_store = DHTProtocol.rpc_store
_original_call_find = DHTProtocol.call_find


def install() -> None:
    """Apply the changes (idempotent). Call before starting a DHT."""
    global _installed
    if _installed:
        return
    DHTProtocol._validate_dictionary = validate_entries
    DHTProtocol.rpc_find = _rpc_find
    DHTProtocol.rpc_store = _rpc_store
    DHTProtocol.call_find = _call_find
    DHTLocalStorage.store_subkey = _store_subkey
    _installed = True
