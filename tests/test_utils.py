"""gpunet.utils.LRU: the bounded dict every peer-fed cache uses, with per-owner shares."""

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from gpunet.utils import LRU


class ScanLRU:
    """The reference: the same rules, by scanning every key (what LRU did before it kept each owner's keys)."""

    def __init__(self, max_items, max_bytes, owner, share):
        self.max_items, self.max_bytes, self.owner = max_items, max_bytes, owner
        self.owner_items = max(1, int(max_items * share))
        self.owner_bytes = None if max_bytes is None else int(max_bytes * share)
        self.items: OrderedDict = OrderedDict()

    def get(self, key):
        if key in self.items:
            self.items.move_to_end(key)
            return self.items[key][0]
        return None

    def pop(self, key):
        item = self.items.pop(key, None)
        return None if item is None else item[0]

    def put(self, key, value, nbytes):
        self.pop(key)
        cap = self.owner_bytes if self.owner_bytes is not None else self.max_bytes
        if cap is not None and nbytes > cap:
            return
        owner = self.owner(key)

        def held():
            mine = [n for k, (_, n) in self.items.items() if self.owner(k) == owner]
            return len(mine), sum(mine)

        for old in [k for k in self.items if self.owner(k) == owner]:
            count, size = held()
            if count + 1 <= self.owner_items and (cap is None or size + nbytes <= cap):
                break
            self.pop(old)
        self.items[key] = (value, nbytes)
        while len(self.items) > 1 and (len(self.items) > self.max_items or (
                self.max_bytes is not None and sum(n for _, n in self.items.values()) > self.max_bytes)):
            self.pop(next(iter(self.items)))


ops = st.lists(st.tuples(st.sampled_from(["put", "get", "pop"]), st.integers(0, 3), st.integers(0, 11),
                         st.integers(0, 40)), max_size=120)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(2, 10), st.sampled_from([None, 60, 150]), st.sampled_from([1.0, 0.5, 0.25]))
def test_owner_shares_match_the_scanning_reference(steps, max_items, max_bytes, share):
    def owner(key):
        return key[0]

    lru, ref = LRU(max_items, max_bytes, owner=owner, share=share), ScanLRU(max_items, max_bytes, owner, share)
    for op, who, k, nbytes in steps:
        key = (who, k)
        if op == "put":
            lru.put(key, (key, nbytes), nbytes)
            ref.put(key, (key, nbytes), nbytes)
        elif op == "get":
            assert lru.get(key) == ref.get(key)
        else:
            assert lru.pop(key) == ref.pop(key)
        assert lru.keys() == list(ref.items)
        assert lru.nbytes == sum(n for _, n in ref.items.values())


def test_one_owner_cannot_push_out_another():
    lru = LRU(8, 1000, owner=lambda key: key[0], share=0.5)
    lru.put(("a", 0), "a0", 10)
    for i in range(100):  # b fills its half again and again: only its own oldest go
        lru.put(("b", i), f"b{i}", 10)
    assert ("a", 0) in lru
    assert [k for k in lru.keys() if k[0] == "b"] == [("b", i) for i in range(96, 100)]
    lru.put(("b", "big"), "big", 500)  # its byte share: 500, so its others make room
    assert lru.keys() == [("a", 0), ("b", "big")]
    lru.put(("b", "huge"), "huge", 501)  # over its share alone: not kept, nothing evicted for it
    assert lru.keys() == [("a", 0), ("b", "big")]


def test_a_read_keeps_an_owners_entry_from_going_first():
    lru = LRU(8, owner=lambda key: key[0], share=0.5)
    for i in range(4):
        lru.put(("a", i), i)
    assert lru.get(("a", 0)) == 0  # now a's most recently used
    lru.put(("a", 4), 4)
    assert ("a", 0) in lru and ("a", 1) not in lru
