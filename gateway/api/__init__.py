"""One package per API the gateway serves, each with its routes, request bodies (`protocol`) and
answers (`formats`), and an `API` that hands them to the app: OpenAI's (`openai`), llama-server's
(`llama`), Anthropic's (`anthropic`), the Responses API (`responses`), and administration
(`admin`). `app` builds the FastAPI app from the one list of them; what every API shares is in
gateway/http/."""
