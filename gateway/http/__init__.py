"""What every API's routes share (torch-free): the steps before a route's own work (`incoming`:
the caller, its rate, the body read by `json_body`, prompts), adapter uploads (`uploads`), what a
body asks of the sampler (`sampling`), how an answer is built (`formatting`) and sent, whole or
streamed (`respond`), the OpenAI error shape (`errors`), what an API package hands the app
(`api`), and every request traced and counted (`observed`)."""
