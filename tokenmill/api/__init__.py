"""What HTTP serving shares between the API server (tokenmill/server/) and the router (tokenmill/router/): the
OpenAI request and response shapes of completions and chat, the one error shape, the lifecycle and drain of an
HTTP process, request tracing, chat rendering, and `tokenmill serve`'s flags (which serve-ray checks its replicas'
against). Neither of those packages imports the other; both import this one."""
