"""gpunet imports hivemind's DHT, p2p and utils without the rest of hivemind, and a program using hivemind beside
gpunet still sees all of it (gpunet.dht.hivemind_parts). Each check runs in a fresh interpreter: sys.modules is
what is tested."""

import os
import subprocess
import sys
import textwrap


def run(code: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                          env=os.environ if env is None else env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_worker_and_a_client_import_no_averaging_moe_optim_or_scipy():
    out = run("""
        import sys
        import gpunet.worker.server, gpunet.client.api, gpunet.cli.app, gpunet.cli.worker, gpunet.llm
        from gpunet.dht.hivemind_parts import package_initialised
        rest = sorted(m for m in sys.modules if m.split(".")[0] == "scipy"
                      or m.startswith(("hivemind.averaging", "hivemind.moe", "hivemind.optim")))
        print(package_initialised(), rest)
    """)
    assert out.split() == ["False", "[]"]


def test_hivemind_used_beside_gpunet_is_whole():
    """Every way of asking the package for a name runs its __init__ once: attributes, from-imports, the version."""
    out = run("""
        import gpunet.client.api
        import hivemind
        from hivemind import DHT, Optimizer
        import hivemind.moe
        from gpunet.dht.hivemind_parts import package_initialised
        assert hivemind.DHT is DHT and hivemind.Optimizer is Optimizer and hivemind.moe.Server
        assert hivemind.DecentralizedAverager.__module__ == "hivemind.averaging.averager"
        try:
            hivemind.no_such_name
        except AttributeError as e:
            print("AttributeError", e)
        print(package_initialised(), hivemind.__version__)
        import importlib
        importlib.reload(hivemind)  # runs __init__ again, as it would without gpunet
        print(package_initialised(), hasattr(hivemind, "no_such_name"), hivemind.DHT is not None)
    """)
    lines = out.splitlines()
    assert lines[0].startswith("AttributeError") and "no_such_name" in lines[0]
    assert lines[1].split()[0] == "True" and lines[1].split()[1].count(".") == 2
    assert lines[2].split() == ["True", "False", "True"]


def test_hivemind_imported_first_is_left_as_it_is():
    out = run("""
        import hivemind
        init = hivemind.__dict__.get("__getattr__")
        import gpunet.worker.server
        import sys
        print(sys.modules["hivemind"] is hivemind, init is None, "hivemind.averaging" in sys.modules)
    """)
    assert out.split() == ["True", "True", "True"]


def test_hivemind_shares_memory_by_descriptor_unless_the_environment_says_otherwise():
    """No torch_shm_manager beside each node (it outlived the CLI holding its stderr: see share_memory_by_descriptor);
    a strategy chosen in the environment stands."""
    code = """
        import gpunet.dht.network, torch.multiprocessing
        print(torch.multiprocessing.get_sharing_strategy())
    """
    unset = {k: v for k, v in os.environ.items() if k != "HIVEMIND_MEMORY_SHARING_STRATEGY"}
    assert run(code, unset).strip() == "file_descriptor"
    assert run(code, {**unset, "HIVEMIND_MEMORY_SHARING_STRATEGY": "file_system"}).strip() == "file_system"
