# Source on the GPU machine: installs the wheels it lacks (carried in bench/build/whl) into /tmp/site,
# py-spy (for --spy-dir) among them when its wheel is there.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  bench/build/whl/grpcio_health_checking-*.whl bench/build/whl/grpcio_reflection-*.whl bench/build/whl/tenacity-*.whl \
  $(ls bench/build/whl/py_spy-*.whl 2>/dev/null) \
  && export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 \
            STRATA_GIT_COMMIT=$(cat .commit 2>/dev/null || echo unknown)
