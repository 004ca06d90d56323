# Source on the GPU machine: installs the wheels it lacks (bench/gpu_wheels.sh downloads them
# here into bench/build/whl; carry that folder) into
# /tmp/site, then Strata itself, editable and without dependencies (the strata.* packages map
# the repository's folders, so a bare PYTHONPATH would not find strata.services).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  bench/build/whl/*.whl \
  && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 \
            STRATA_GIT_COMMIT=$(cat .commit 2>/dev/null || echo unknown) \
            NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
  && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e .
