"""llama-server's own API: /completion, /tokenize, /detokenize, /apply-template, /lora-adapters,
/props and /slots (`routes`), their bodies (`protocol`), the sampler's parameters as llama.cpp
reads and reports them (`sampling`) and their answers (`formats`)."""

from gateway.api.llama import routes
from gateway.api.llama.protocol import (
    ApplyTemplateRequest,
    DetokenizeRequest,
    LlamaCompletionRequest,
    LoraScale,
    TokenizeRequest,
)
from gateway.http.api import Api

API = Api("llama-server", (routes.router,), {
    "/completion": LlamaCompletionRequest, "/completions": LlamaCompletionRequest, "/lora-adapters": list[LoraScale],
    "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest, "/apply-template": ApplyTemplateRequest,
})
