"""The worker's pure state machines: one event in, decisions (or actions) out; no sockets, no sleeping, no logging,
the clock passed in — tested without a network (dask/distributed's ``worker_state_machine`` is the model).

* :mod:`.admission` — what the worker takes, from whom, and what each client may hold;
* :mod:`.lanes` — which admitted job runs next, at what price, and which one an interactive job stops;
* :mod:`.sessions` — the inference sessions held here and their tabs;
* :mod:`.pushes` — session inputs pushed by the span before, and the steps waiting for them;
* :mod:`.availability` — when the owner's machine is theirs again;
* :mod:`.owners` — who may run a program held here without sending it; :mod:`.limits` — the typed limits, and a
  session step as the executor runs it.
"""
