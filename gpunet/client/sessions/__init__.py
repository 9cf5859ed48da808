"""Models spread over workers, Petals-style, and inference sessions whose state stays on the workers
(docs/sessions.md): ``spans`` cuts and traces the blocks, ``session`` runs passes and sessions (placing, moving and
replaying spans), ``audit`` checks live steps against replays, ``handles`` are what the user holds.
"""

from gpunet.client.sessions.audit import CheckReport
from gpunet.client.sessions.handles import AsyncRemoteSequential, AsyncSession, RemoteSequential, Session
from gpunet.client.sessions.session import SequentialCore, SessionCore, build
from gpunet.client.sessions.spans import Span

__all__ = ["AsyncRemoteSequential", "AsyncSession", "CheckReport", "RemoteSequential", "Session", "SequentialCore",
           "SessionCore", "Span", "build"]
