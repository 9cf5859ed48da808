"""A worker's spooled program (gpunet/worker/spool.py): bytes-like to whoever reads it, its disk blocks reserved up
front, and memory instead where the spool cannot take it."""

import hashlib
import os

from gpunet.worker.spool import SPOOL_BYTES, SpooledProgram, program_buffer


def test_a_spooled_program_reads_as_the_bytes_written_and_reserves_its_blocks(tmp_path):
    buffer = program_buffer(SPOOL_BYTES, str(tmp_path))
    assert isinstance(buffer, SpooledProgram)
    # Reserved, not sparse: a write to a mapped page must never find the disk full (SIGBUS would kill the worker).
    assert os.fstat(buffer.fileno()).st_blocks * 512 >= SPOOL_BYTES
    data = os.urandom(1 << 20)
    buffer[5 << 20:6 << 20] = data
    whole = bytearray(SPOOL_BYTES)
    whole[5 << 20:6 << 20] = data
    assert buffer[5 << 20:6 << 20] == data and bytes(memoryview(buffer)[5 << 20:(5 << 20) + 8]) == data[:8]
    assert hashlib.sha256(buffer).digest() == hashlib.sha256(whole).digest()
    assert not os.listdir(tmp_path)  # unlinked from the start


def test_small_programs_and_a_spool_that_cannot_take_one_stay_in_memory(tmp_path, caplog):
    assert type(program_buffer(SPOOL_BYTES - 1, str(tmp_path))) is bytearray
    assert type(program_buffer(SPOOL_BYTES, None)) is bytearray
    assert type(program_buffer(SPOOL_BYTES, str(tmp_path / "gone"))) is bytearray
    assert "assembling it in memory" in caplog.text
