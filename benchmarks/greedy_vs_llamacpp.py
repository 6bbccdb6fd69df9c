"""Do onecall and llama.cpp write the same greedy tokens from a GGUF? A by-hand cross-check of a
family's GGUF reading and model code against llama.cpp itself (llama-cpp-python, installed by hand).

    python benchmarks/greedy_vs_llamacpp.py /tmp/onecall-mixes/qwen3.5-0.5b-F16.gguf
    python benchmarks/greedy_vs_llamacpp.py FILE --tokens 32 --prompt "Once upon a time"

Both engines get the same prompt ids (onecall's tokenizer), greedy, EOS ignored; prints both token
lists and how many leading tokens agree. On random-weight files the logits are flat, so a 4-bit file
may part after a few tokens from arithmetic alone (onecall's and llama.cpp's 4-bit products round
differently); an F16 or F32 file should agree for the whole run."""

from __future__ import annotations

import argparse


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--prompt", default="The history of the city begins with")
    args = ap.parse_args()

    import llama_cpp

    from onecall import LLM, SamplingParams

    with LLM(model=args.gguf) as llm:
        ids = llm.tokenizer.encode(args.prompt)
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        ours = list(llm.generate([ids], params)[0].token_ids)
    theirs: list[int] = []
    peer = llama_cpp.Llama(model_path=args.gguf, n_ctx=len(ids) + args.tokens + 8, verbose=False)
    for token in peer.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
        theirs.append(int(token))
        if len(theirs) == args.tokens:
            break
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), args.tokens)
    print(f"onecall   {ours}\nllama.cpp {theirs}\nthe first {same} of {args.tokens} tokens agree")


if __name__ == "__main__":
    main()
