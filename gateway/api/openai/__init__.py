"""The OpenAI API: completions, chat completions and models (`routes`), their request bodies
(`protocol`), what they ask of the sampler (gateway/http/sampling.py) and their answers (`formats`)."""

from gateway.api.openai import routes
from gateway.api.openai.protocol import ChatRequest, CompletionRequest
from gateway.http.api import Api

API = Api("openai", (routes.router,), {
    "/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest, "/chat/completions": ChatRequest,
    "/v1/chat/completions/input_tokens": ChatRequest, "/chat/completions/input_tokens": ChatRequest,
})
