// OpenFeature's Node OFREP provider (@openfeature/ofrep-provider with @openfeature/server-sdk), unchanged,
// evaluating a running pasto server. Run by tests/client/test_typescript_client.py, which starts the
// server, gives the units and checks what this prints (one JSON document on stdout):
//   PASTO_URL, PASTO_TOKEN, PASTO_FLAG (an experiment), PASTO_SEGMENTED_FLAG (a segmented one),
//   PASTO_UNITS (a file with a JSON list of units).
import { readFileSync } from "node:fs";

import { OFREPProvider } from "@openfeature/ofrep-provider";
import { EvaluationContext, JsonValue, OpenFeature } from "@openfeature/server-sdk";

const environment = (name: string): string => {
  const value = process.env[name];
  if (value === undefined) throw new Error(`Set ${name}.`);
  return value;
};

async function main(): Promise<void> {
  const token = environment("PASTO_TOKEN");
  await OpenFeature.setProviderAndWait(new OFREPProvider({
    baseUrl: environment("PASTO_URL"), headers: [["Authorization", `Bearer ${token}`]],
  }));
  const client = OpenFeature.getClient();
  const flag = environment("PASTO_FLAG");
  const units: string[] = JSON.parse(readFileSync(environment("PASTO_UNITS"), "utf8"));
  const evaluate = async (key: string, context: EvaluationContext) => {
    const details = await client.getObjectDetails(key, { fallback: true } as JsonValue, context);
    return { variant: details.variant ?? null, value: details.value, reason: details.reason ?? null,
             metadata: details.flagMetadata, errorCode: details.errorCode ?? null };
  };
  const evaluations = [];
  for (const unit of units) {
    evaluations.push(await evaluate(flag, { targetingKey: unit, country: "fr" }));
  }
  const segmented = environment("PASTO_SEGMENTED_FLAG");
  const errors = {
    noTargetingKey: await evaluate(flag, { country: "fr" }),
    unknownFlag: await evaluate("no-such-experiment", { targetingKey: "u" }),
    overlongUnit: await evaluate(flag, { targetingKey: "u".repeat(300) }),
    noSegment: await evaluate(segmented, { targetingKey: "u" }),
    unknownSegment: await evaluate(segmented, { targetingKey: "u", segment: "tv" }),
    web: await evaluate(segmented, { targetingKey: "u", segment: "web" }),
  };
  await OpenFeature.close();
  process.stdout.write(JSON.stringify({ evaluations, errors }));
}

main().catch((error) => {
  process.stderr.write(`${error?.stack ?? error}\n`);
  process.exit(1);
});
