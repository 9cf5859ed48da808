import dataclasses

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpunet.errors import InvalidReceipt
from gpunet.ledger import (
    Identity,
    Receipt,
    attach_countersignature,
    compute_amount,
    countersign,
    format_credits,
    price_to_nano,
)
from tests._ledger_util import digest, full_receipt, worker_signed

WORKER, CLIENT, OTHER = Identity.generate(), Identity.generate(), Identity.generate()


def test_flow_produces_a_receipt_both_signatures_verify():
    half = worker_signed(WORKER, CLIENT, "job-1")
    assert not half.is_countersigned
    with pytest.raises(InvalidReceipt, match="not countersigned"):
        half.verify()
    signed = countersign(half, CLIENT, output_hash=digest("out-job-1"), max_price=3_000_000, flops=3 * 10**12)
    complete = attach_countersignature(half, signed.client_signature)
    complete.verify()
    assert complete == signed
    assert complete.amount == 7_500_000  # 3 TFLOP at 0.0025 credits/TFLOP = 0.0075 credits, in nano-credits
    assert complete.worker_id == WORKER.peer_id and complete.client_id == CLIENT.peer_id


def test_encoding_round_trips_and_is_deterministic():
    r = full_receipt(WORKER, CLIENT, "job-enc", max_price=None)
    data = r.to_bytes()
    again = Receipt.from_bytes(data)
    assert again == r and again.to_bytes() == data
    rebuilt = Receipt(**{f.name: getattr(r, f.name) for f in dataclasses.fields(Receipt) if f.init})
    assert rebuilt.body == r.body and rebuilt.signing_bytes() == r.signing_bytes()


def test_client_refuses_a_receipt_that_does_not_match_what_it_got():
    half = worker_signed(WORKER, CLIENT, "job-2")
    good = dict(output_hash=half.output_hash, max_price=3_000_000)
    with pytest.raises(InvalidReceipt, match="output hash"):
        countersign(half, CLIENT, **{**good, "output_hash": digest("something else")})
    with pytest.raises(InvalidReceipt, match="price bound"):
        countersign(half, CLIENT, **{**good, "max_price": 2_000_000})
    with pytest.raises(InvalidReceipt, match="FLOPs"):
        countersign(half, CLIENT, **good, flops=half.flops - 1)
    with pytest.raises(InvalidReceipt, match="not this client"):
        countersign(half, OTHER, **good)
    forged = dataclasses.replace(half, worker_signature=OTHER.sign(half.signing_bytes()))
    with pytest.raises(InvalidReceipt, match="worker signature"):
        countersign(forged, CLIENT, **good)
    inflated = dataclasses.replace(half, amount=half.amount + 1)
    with pytest.raises(InvalidReceipt, match="amount"):
        countersign(inflated, CLIENT, **good)


def test_worker_cannot_bill_above_the_clients_bound():
    with pytest.raises(InvalidReceipt, match="above the client's bound"):
        worker_signed(WORKER, CLIENT, "job-3", price=3_000_001, max_price=3_000_000)


def test_worker_refuses_a_bad_countersignature():
    half = worker_signed(WORKER, CLIENT, "job-4")
    with pytest.raises(InvalidReceipt, match="client signature"):
        attach_countersignature(half, OTHER.sign(half.signing_bytes()))
    with pytest.raises(InvalidReceipt, match="client signature"):
        attach_countersignature(half, CLIENT.sign(b"some other message"))


def test_any_changed_field_breaks_both_signatures():
    r = full_receipt(WORKER, CLIENT, "job-5")
    for name, value in [("flops", r.flops + 10**15), ("output_hash", digest("x")), ("job_id", "job-6"),
                        ("ended_at_us", r.ended_at_us + 1), ("worker_id", OTHER.peer_id)]:  # fmt: skip
        changed = dataclasses.replace(r, **{name: value})
        if name == "flops":
            changed = dataclasses.replace(changed, amount=compute_amount(changed.flops, r.price))
        with pytest.raises(InvalidReceipt, match="signature"):
            changed.verify()


def test_self_dealing_and_non_ed25519_ids_are_refused():
    with pytest.raises(InvalidReceipt, match="same identity"):
        worker_signed(WORKER, WORKER, "job-7")
    unsigned = dataclasses.replace(
        full_receipt(WORKER, CLIENT, "job-8"), client_id="QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
    )
    r = dataclasses.replace(unsigned, worker_signature=WORKER.sign(unsigned.signing_bytes()))
    with pytest.raises(InvalidReceipt, match="client id .* is not an Ed25519 peer id"):
        r.verify()


def test_non_canonical_and_foreign_encodings_are_refused():
    r = full_receipt(WORKER, CLIENT, "job-9")
    fields = msgpack.unpackb(r.body)
    # Same values, but flops packed as a float64: a second byte string for the same receipt.
    fields[7] = float(fields[7])
    odd_body = msgpack.packb(fields)
    with pytest.raises(InvalidReceipt):
        Receipt.from_bytes(msgpack.packb([odd_body, r.worker_signature, r.client_signature]))
    # A body whose ints use a wider msgpack form than needed decodes to the same values but is not canonical.
    wide = r.body.replace(b"\xcd\x30\x39", b"\xce\x00\x00\x30\x39")  # wall_time_us=12345 as uint32
    assert wide != r.body
    with pytest.raises(InvalidReceipt, match="canonical"):
        Receipt.from_bytes(msgpack.packb([wide, r.worker_signature, r.client_signature]))
    future = msgpack.packb([4, *msgpack.unpackb(r.body)[1:]])
    with pytest.raises(InvalidReceipt, match="version 4"):
        Receipt.from_bytes(msgpack.packb([future, b"", b""]))
    with pytest.raises(InvalidReceipt):
        Receipt.from_bytes(b"x" * 5000)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_garbage_bytes_are_an_invalid_receipt_never_a_crash(data):
    with pytest.raises(InvalidReceipt):
        Receipt.from_bytes(data)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**64 - 1), st.integers(0, 10**12))
def test_amount_is_exact_integer_arithmetic(flops, price):
    amount = compute_amount(flops, price)
    assert (amount - 1) * 10**12 < flops * price <= amount * 10**12  # rounded up, by less than one nano-credit


def test_paid_work_is_never_worth_zero():
    default = price_to_nano(1.0)  # a worker's default price, credits per TFLOP
    assert compute_amount(1, default) == 1  # one FLOP still earns a nano-credit
    assert format_credits(compute_amount(10**6, default)) == "0.000001"  # a 1 MFLOP job
    assert format_credits(compute_amount(3 * 10**9, default)) == "0.003"
    assert compute_amount(0, default) == 0 and compute_amount(10**15, 0) == 0  # no work, or free work: nothing


def test_a_job_too_big_to_bill_is_refused_with_the_reason():
    with pytest.raises(InvalidReceipt, match="split the work"):
        worker_signed(WORKER, CLIENT, "job-huge", flops=2**64 - 1, price=10**13, max_price=None)


def test_prices_and_credits_are_exact_decimals():
    assert price_to_nano(0.1) == 100_000_000
    assert price_to_nano("2.5") == 2_500_000_000
    assert price_to_nano(1e-10) == 0
    assert format_credits(1_234_567_000) == "1.234567" and format_credits(1_500_000_000) == "1.50"
    assert format_credits(-5) == "-0.000000005" and format_credits(0) == "0.00"
    for bad in (-1, "nan", "abc", float("inf")):
        with pytest.raises(InvalidReceipt):
            price_to_nano(bad)


def _v1_receipt(job_id: str, *, flops: int, price: int) -> Receipt:
    """A receipt as gpunet signed them before format 2 (micro-credits per PFLOP, amounts in micro-credits rounded
    down), built and signed by hand."""
    unsigned = Receipt(job_id=job_id, client_id=CLIENT.peer_id, worker_id=WORKER.peer_id, program_hash=digest("p"),
                       input_hash=digest("i"), output_hash=digest("o"), flops=flops, wall_time_us=1, price=price,
                       max_price=None, amount=compute_amount(flops, price, version=1), started_at_us=1,
                       ended_at_us=2, version=1)
    assert unsigned.signing_bytes().startswith(b"gpunet/receipt/v1\x00")
    assert msgpack.unpackb(unsigned.body)[0] == 1
    half = dataclasses.replace(unsigned, worker_signature=WORKER.sign(unsigned.signing_bytes()))
    return dataclasses.replace(half, client_signature=CLIENT.sign(half.signing_bytes()))


def test_format_1_receipts_still_verify_with_their_amounts_in_nano_credits(tmp_path):
    from gpunet.ledger import open_ledger

    old = _v1_receipt("job-v1", flops=2 * 10**15, price=3_000_000)  # 2 PFLOP at 3 credits/PFLOP = 6 credits
    again = Receipt.from_bytes(old.to_bytes())
    again.verify()
    assert again.version == 1 and again.amount == 6 * 10**9 and format_credits(again.amount) == "6.00"
    assert msgpack.unpackb(msgpack.unpackb(old.to_bytes())[0])[11] == 6_000_000  # signed as micro-credits
    with open_ledger(tmp_path) as ledger:
        ledger.append(again)
        ledger.append(full_receipt(WORKER, CLIENT, "job-v2", flops=10**12, price=10**9, max_price=None))  # 1 credit
        ledger.verify()
        assert ledger.balances()[WORKER.peer_id].earned == 7 * 10**9
    # The format is signed: the same fields presented as format 2 do not verify with the format-1 signatures.
    as_v2 = dataclasses.replace(old, version=2, amount=compute_amount(old.flops, old.price))
    with pytest.raises(InvalidReceipt, match="signature"):
        as_v2.verify()


def test_receipts_say_which_lane_they_were_sold_in_and_format_2_reads_as_interactive(tmp_path):
    from gpunet.ledger import open_ledger
    from gpunet.ledger.receipts import countersign, sign_as_worker

    batch = sign_as_worker(WORKER, job_id="job-batch", client_id=CLIENT.peer_id, program_hash=digest("p"),
                           input_hash=digest("i"), output_hash=digest("o"), flops=10**12, wall_time_us=1,
                           price=5 * 10**8, max_price=10**9, started_at_us=1, ended_at_us=2, lane="batch")
    assert msgpack.unpackb(batch.body)[0] == 3 and msgpack.unpackb(batch.body)[-1] == "batch"
    with pytest.raises(InvalidReceipt, match="lane"):  # a worker cannot bill a batch job as anything else, nor back
        countersign(batch, CLIENT, output_hash=digest("o"), max_price=10**9, lane="interactive")
    paid = countersign(batch, CLIENT, output_hash=digest("o"), max_price=10**9, lane="batch")
    again = Receipt.from_bytes(paid.to_bytes())
    again.verify()
    assert again.lane == "batch" and again.to_dict()["lane"] == "batch" and again.amount == 5 * 10**8
    # A format-2 receipt (signed before lanes): no lane in its body, read as interactive, verifies as signed.
    unsigned = Receipt(job_id="job-v2", client_id=CLIENT.peer_id, worker_id=WORKER.peer_id, program_hash=digest("p"),
                       input_hash=digest("i"), output_hash=digest("o"), flops=10**12, wall_time_us=1, price=10**9,
                       max_price=None, amount=10**9, started_at_us=1, ended_at_us=2, version=2)
    assert len(msgpack.unpackb(unsigned.body)) == 14 and unsigned.signing_bytes().startswith(b"gpunet/receipt/v2\x00")
    half = dataclasses.replace(unsigned, worker_signature=WORKER.sign(unsigned.signing_bytes()))
    old = Receipt.from_bytes(countersign(half, CLIENT, output_hash=digest("o"), max_price=None, lane="batch").to_bytes())
    old.verify()
    assert old.version == 2 and old.lane == "interactive" and old.to_dict()["lane"] == "interactive"
    with pytest.raises(InvalidReceipt, match="no lane"):
        dataclasses.replace(unsigned, lane="batch")
    with pytest.raises(InvalidReceipt, match="lane"):
        dataclasses.replace(paid, lane="Batch!")
    with open_ledger(tmp_path) as ledger:
        ledger.append(again)
        ledger.append(old)
        ledger.verify()
        assert ledger.balances()[WORKER.peer_id].earned == 15 * 10**8


@pytest.mark.parametrize(
    "field, value",
    [("flops", 1.5), ("flops", -1), ("flops", True), ("job_id", ""), ("job_id", "x" * 200), ("job_id", "a\nb"),
     ("price", 2**64), ("worker_signature", b"short"), ("max_price", "3")],
)  # fmt: skip
def test_malformed_fields_are_refused_at_construction(field, value):
    r = full_receipt(WORKER, CLIENT, "job-10")
    with pytest.raises(InvalidReceipt, match=field.split("_")[0]):
        dataclasses.replace(r, **{field: value})


def test_one_receipt_has_one_byte_string():
    r = full_receipt(WORKER, CLIENT, "job-env")
    body, ws, cs = msgpack.unpackb(r.to_bytes())
    wide = b"\xdc\x00\x03" + b"".join(msgpack.packb(x, use_bin_type=True) for x in (body, ws, cs))  # array16 header
    with pytest.raises(InvalidReceipt, match="envelope"):
        Receipt.from_bytes(wide)
