"""Append receipts to a ledger until killed, printing each job id once its append has returned.

Run by the crash test: ``python _ledger_append_loop.py LEDGER_PATH JOB_PREFIX``.
"""

import sys

from gpunet.ledger import Identity, Ledger
from tests._ledger_util import full_receipt

path, prefix = sys.argv[1], sys.argv[2]
worker, client = Identity.generate(), Identity.generate()
with Ledger(path) as ledger:
    i = 0
    while True:
        receipt = full_receipt(worker, client, f"{prefix}-{i}")
        ledger.append(receipt)
        print(receipt.job_id, flush=True)
        i += 1
