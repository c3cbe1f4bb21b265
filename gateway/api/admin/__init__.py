"""The operator's and tenants' administration API: adapters (`adapters`), tenants and their keys
(`tenants`), operator keys and the audit log (`operator_keys`), usage (`usage`), and health and
metrics (`operator`)."""

from gateway.api.admin import adapters, operator, operator_keys, tenants, usage
from gateway.api.admin.adapters import LoadLoRARequest, UnloadLoRARequest
from gateway.http.api import Api

API = Api("admin", (operator.router, operator_keys.router, adapters.router, tenants.router, usage.router),
          {"/v1/load_lora_adapter": LoadLoRARequest, "/v1/unload_lora_adapter": UnloadLoRARequest})
