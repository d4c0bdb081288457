"""The HTTP front doors: each API's routes (OpenAI, Responses, shortfin's /generate, WebSocket,
tokenizer, admin), the middleware every request passes, connection deadlines, server-sent events."""
