# Sourced by recipes/retrieval.sh and recipes/retrieval_choices.sh (needs DATA, PAIRS, PYTHON): the supervised
# pairs and the choices that go with them.
# - files: the 8 files of DATA/train/ (none from the dev-suite tasks; not STSBenchmark train, which leaks into
#   the STS tasks), plus inverse-cloze pairs from DATA/pretrain/ without the enwiki-gensim articles (WIKI=1,
#   the default; built into PAIRS once).
# - QUERY_PROMPT: the query prompt of the asymmetric sources (a query against a passage: QA, inverse cloze,
#   package summary -> description), one generic instruction, the one mteb and the server apply to every
#   retrieval query; documents take none. SYMMETRIC: the sources whose two sides are alike (paraphrase, NLI,
#   question entailment), which take no prompt on either side, as texts embed in STS, classification and
#   clustering. MRL_DIMS: the Matryoshka prefix sizes trained beside the full vector.
WIKI=${WIKI:-1}
QUERY_PROMPT=${QUERY_PROMPT:-$'Instruct: Given a search query, retrieve relevant passages\nQuery: '}
SYMMETRIC=${SYMMETRIC:-mrpc_train_paraphrase,parasci_paraphrase,snli_counterfactual_cad,snli_subset_cat,medical_question_entailment_rqe}
MRL_DIMS=${MRL_DIMS:-64,128,256}
files=$(printf '%s,' "$DATA"/train/*.jsonl)
files=${files%,}
if [ "$WIKI" = 1 ]; then
  if [ ! -f "$PAIRS/wiki_ict.jsonl" ]; then
    $PYTHON recipes/make_pairs_wiki.py --pretrain "$DATA/pretrain/wikipedia_paragraphs.jsonl" \
      --output "$PAIRS/wiki_ict.jsonl"
  fi
  files="$files,$PAIRS/wiki_ict.jsonl"
fi
