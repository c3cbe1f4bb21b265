"""The Anthropic Messages API: /v1/messages and its token count (`routes`), their bodies
(`protocol`), and their answers and error shape (`formats`)."""

from gateway.api.anthropic import routes
from gateway.api.anthropic.formats import anthropic_error
from gateway.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from gateway.http.api import Api

API = Api("anthropic", (routes.router,),
          {"/v1/messages": MessagesRequest, "/v1/messages/count_tokens": CountTokensRequest},
          error_shape=anthropic_error, error_paths=("/v1/messages",))
