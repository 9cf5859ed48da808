"""The ledger: identity keys, receipts signed by both sides, the hash-chained SQLite store, balances, verify, merge.

Public API::

    from gpunet.ledger import open_ledger
    with open_ledger() as ledger:            # <data dir>/ledger.sqlite
        ledger.balances(); ledger.receipts(); ledger.get(job_id); ledger.verify(); ledger.head()
"""

from gpunet.config import resolve_data_dir
from gpunet.identity import Identity
from gpunet.ledger.balances import Balance, balances
from gpunet.ledger.entries import Conflict, Entry, LedgerHead, MergeReport, Unbilled
from gpunet.ledger.receipts import (
    FORMAT_VERSION,
    Receipt,
    attach_countersignature,
    compute_amount,
    countersign,
    format_credits,
    price_to_nano,
    sign_as_worker,
)
from gpunet.ledger.store import Ledger, open_ledger

__all__ = [
    "FORMAT_VERSION",
    "Balance",
    "Conflict",
    "Entry",
    "Identity",
    "Ledger",
    "LedgerHead",
    "MergeReport",
    "Receipt",
    "Unbilled",
    "attach_countersignature",
    "balances",
    "compute_amount",
    "countersign",
    "format_credits",
    "open_ledger",
    "price_to_nano",
    "resolve_data_dir",
    "sign_as_worker",
]
