"""Chat templates of real models, for tests that need a template's own behaviour.

GEMMA2: Gemma 2's `chat_template` (google/gemma-2-2b-it's tokenizer_config.json), which has no
system role: a system message is `raise_exception('System role not supported')`.
GEMMA_LLAMACPP: llama.cpp's rendering of GEMMA_CONVERSATION with its own Gemma template
(`llama_chat_apply_template(b"gemma", ...)`, add_ass true, through llama-cpp-python 0.3.36),
which puts the trimmed system text at the start of the first user message, a blank line after
it; llama.cpp adds the BOS token when it tokenizes, the Jinja template writes it itself.
"""

GEMMA2 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System "
          "role not supported') }}{% endif %}{% for message in messages %}{% if (message['role']"
          " == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must "
          "alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
          "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
          "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
          "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{'<start_of_turn>model\n'}}{% endif %}")

GEMMA_SYSTEM = "  You are terse. "
GEMMA_CONVERSATION = [{"role": "user", "content": "What is a list?"},
                      {"role": "assistant", "content": "A sequence."},
                      {"role": "user", "content": "And a dict?"}]
GEMMA_LLAMACPP = ("<start_of_turn>user\nYou are terse.\n\nWhat is a list?<end_of_turn>\n"
                  "<start_of_turn>model\nA sequence.<end_of_turn>\n"
                  "<start_of_turn>user\nAnd a dict?<end_of_turn>\n<start_of_turn>model\n")
