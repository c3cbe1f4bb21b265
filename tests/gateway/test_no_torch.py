"""The gateway side (and everything it uses from worker/) never imports torch."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
import cache, cache.keys, cache.codec, cache.l1, cache.l2, cache.stats, cache.prefix, gateway, gateway.cli
import gateway.config, gateway.catalog, gateway.protocol, gateway.tenants, gateway.routing, gateway.ratelimit
import gateway.metrics, gateway.formats, gateway.core, gateway.app, gateway.placement, gateway.plan
import gateway.loadtest.scenario, gateway.loadtest.generators, gateway.loadtest.runner, gateway.loadtest.report, gateway.loadtest.cli
from gateway.catalog import Catalog
from gateway.config import load_config
Catalog(load_config())  # the default deployment's model and adapters, as the gateway reads them
import worker.engine.params, worker.engine.scheduler, worker.engine.stop, worker.engine.outputs
import worker, worker.formats.adapter, worker.formats.alora, worker.formats.chat_template, worker.formats.fingerprint
import worker.formats.gguf_file, worker.formats.hparams, worker.formats.peft_convert, worker.formats.tokenizer, worker.formats.default_model
from worker.cli.inspect import describe
describe(sys.argv[1], sys.argv[2])
describe(sys.argv[2], None)
assert "torch" not in sys.modules, sorted(m for m in sys.modules if m.startswith("torch"))
print("ok")
"""


def test_gateway_and_torch_free_worker_modules_do_not_load_torch(small_adapter_path, real_model_path) -> None:
    done = subprocess.run([sys.executable, "-c", CODE, str(small_adapter_path), str(real_model_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
