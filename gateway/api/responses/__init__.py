"""The OpenAI Responses API: /v1/responses (`routes`), its bodies (`protocol`), and its answers and
events (`formats`); the responses it keeps for `previous_response_id` are in
gateway/requests/response_store.py."""

from gateway.api.responses import routes
from gateway.api.responses.protocol import ResponsesRequest
from gateway.http.api import Api

API = Api("responses", (routes.router,), {"/v1/responses": ResponsesRequest, "/responses": ResponsesRequest})
