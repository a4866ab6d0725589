"""A tiny harness (the openai SDK) whose second call rewrites the history: it edits the system
prompt and trims the first answer. Its calls cannot merge: the break is named."""

import openai

client = openai.OpenAI()
first = client.chat.completions.create(
    model="tiny", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
)
answer = first.choices[0].message.content
client.chat.completions.create(
    model="tiny",
    messages=[
        {"role": "system", "content": "Be very brief."},
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": answer[:20]},
        {"role": "user", "content": "Again."},
    ],
)
