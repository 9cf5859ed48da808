#!/usr/bin/env bash
# Fill ./.whl with what a GPU machine lent through the device tool lacks: its image has Python 3.12 and the CUDA build
# of torch (and numpy, scipy, msgpack, uvloop, aiohttp, typer, rich, ...) but not hivemind and the rest of gpunet's
# needs, and it reaches no registry. Run here (where pip reaches PyPI), then `bash scripts/gpu_check.sh` there with
# .whl carried. The versions are those scripts/install.sh gave on 2026-12-04. (.whl is git-ignored.)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
binary=(hivemind==1.1.12 annotated-types==0.8.0 base58==2.1.1 blake3==1.0.11 cffi==2.1.1 configargparse==1.9.0
        cryptography==50.0.2 mmh3==5.3.1 morphys==1.0 netaddr==1.3.0 py-cid==0.5.0 py-multibase==2.0.0
        py-multicodec==1.0.0 py-multihash==3.0.0 pycparser==3.12 pydantic==2.14.4 pydantic-core==2.50.5
        typing-inspection==0.4.5 protobuf==7.36.2 typing-extensions==4.16.0
        # gpunet[llm] (bench_llm): transformers and what it needs beyond the image's
        transformers==5.25.0 tokenizers==0.23.3 huggingface-hub==2.4.0 safetensors==0.8.0 regex==2026.11.19
        hf-xet==1.8.0 filelock==4.3.2 fsspec==2026.9.0 pyyaml==6.0.4 tqdm==4.70.1 packaging==26.4
        # the GPU tests (tests/test_graphs.py -k on_a_gpu)
        pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 pygments==2.21.0)
for p in "${binary[@]}"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux1_x86_64 --platform any --abi cp312 --abi abi3 --abi none -d .whl "$p"
done
# Published as source only (pure Python): built into wheels here.
python3 -m pip wheel -q --no-deps -w .whl prefetch-generator==1.0.3 python-baseconv==1.2.2 varint==1.0.2
du -sh .whl
