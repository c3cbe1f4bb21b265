"""The HTTP edge (torch-free): request bodies (`protocol`, `llama_protocol`, read by `json_body`;
adapter uploads by `uploads`), what they ask of the sampler (`sampling`) and of tools (`tools`),
response bodies (`formats`, `llama_formats`), one router per API (`openai_routes`, `llama_routes`,
`adapters`, `operator_routes`) over the steps every request shares (`incoming`) and its answer
(`respond`), all put together in `app`."""
